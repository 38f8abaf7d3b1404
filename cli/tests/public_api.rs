//! The public API of the library crates, recorded and checked: every item
//! a user of `nixl-keepalive`, `nixl-agent`, `nixl-sys` or `ucx-sys` can
//! name is one line of `api/<crate>.txt`, and this test fails when the
//! source no longer says what the file says. A change of the API is then
//! a change of that file too, seen in review (and, when it breaks users,
//! in `CHANGELOG.md`).
//!
//! After a change made on purpose, write the files again and commit them
//! with the change:
//!
//! ```sh
//! UPDATE_API=1 cargo test -p nixl-keepalive-cli --test public_api
//! ```
//!
//! # What a line records
//! Walked from the crate root with `syn` (rustdoc's JSON, which
//! `cargo public-api` reads, needs a nightly toolchain): every public
//! module, every `pub` item reachable through public modules and `pub use`
//! re-exports (each at the path a user names it by), with
//! - structs: derives, `#[non_exhaustive]`, each public field and its
//!   type, and whether private fields exist (no struct literal then);
//! - enums: derives, `#[non_exhaustive]`, each variant with its fields;
//! - functions, methods and trait items: the signature as written
//!   (whitespace collapsed); constants and statics: their type; type
//!   aliases: the aliased type;
//! - impls of a public type anywhere in the crate: each `pub` method and
//!   constant of an inherent impl, and each trait impl's header;
//! - `#[doc(hidden)]` and `#[cfg(...)]` (features) on the item or a module
//!   above it.
//!
//! # Limits
//! - `macro_rules!` are not expanded: a macro's definition and each
//!   item-level call of it (in a module that is not test code) are one
//!   line each with a hash of their text, so a change to what a macro
//!   makes changes the file, but the file does not say what changed. The
//!   names a macro defines and the crate re-exports are listed as
//!   re-exports of a macro-made item.
//! - A type's impls are found by its name: where two types of one crate
//!   share a name, only impls in the module that defines each count.
//! - Auto traits (`Send`, `Sync`, ...) are not recorded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;

/// One module: its items, and what its `use`s bind.
struct Module {
    path: Vec<String>,
    /// The module's own source text (spans index into it).
    source: std::rc::Rc<str>,
    items: Vec<syn::Item>,
    public: bool,
    /// `#[doc(hidden)]` and `cfg`s on it or any module above it.
    marks: Vec<String>,
    children: BTreeMap<String, usize>,
}

struct Crate {
    name: String,
    modules: Vec<Module>,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn load(name: &str, root: &Path) -> Crate {
    let mut krate = Crate {
        name: name.replace('-', "_"),
        modules: Vec::new(),
    };
    let file = root.join("src/lib.rs");
    let text: std::rc::Rc<str> = fs::read_to_string(&file).unwrap().into();
    let parsed = syn::parse_file(&text).unwrap();
    add_module(
        &mut krate,
        Vec::new(),
        file,
        text,
        parsed.items,
        true,
        Vec::new(),
    );
    krate
}

fn add_module(
    krate: &mut Crate,
    path: Vec<String>,
    file: PathBuf,
    source: std::rc::Rc<str>,
    items: Vec<syn::Item>,
    public: bool,
    marks: Vec<String>,
) -> usize {
    let index = krate.modules.len();
    krate.modules.push(Module {
        path: path.clone(),
        source: source.clone(),
        items: Vec::new(),
        public,
        marks: marks.clone(),
        children: BTreeMap::new(),
    });
    let mut kept = Vec::new();
    for item in items {
        if is_test(attrs_of(&item)) {
            continue;
        }
        if let syn::Item::Mod(m) = &item {
            let name = m.ident.to_string();
            let mut child_marks = marks.clone();
            child_marks.extend(item_marks(&m.attrs));
            let child_public = public && is_pub(&m.vis);
            let mut child_path = path.clone();
            child_path.push(name.clone());
            let child = match &m.content {
                Some((_, inner)) => add_module(
                    krate,
                    child_path,
                    file.clone(),
                    source.clone(),
                    inner.clone(),
                    child_public,
                    child_marks,
                ),
                None => {
                    let child_file = module_file(&file, &name, &m.attrs);
                    let text: std::rc::Rc<str> = fs::read_to_string(&child_file)
                        .unwrap_or_else(|e| panic!("{}: {e}", child_file.display()))
                        .into();
                    let parsed = syn::parse_file(&text).unwrap();
                    add_module(
                        krate,
                        child_path,
                        child_file,
                        text,
                        parsed.items,
                        child_public,
                        child_marks,
                    )
                }
            };
            krate.modules[index].children.insert(name, child);
            continue;
        }
        kept.push(item);
    }
    krate.modules[index].items = kept;
    index
}

/// Where `mod name;` declared in `parent` lives.
fn module_file(parent: &Path, name: &str, attrs: &[syn::Attribute]) -> PathBuf {
    let dir = parent.parent().unwrap();
    for a in attrs {
        if a.path().is_ident("path") {
            if let syn::Meta::NameValue(nv) = &a.meta {
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) = &nv.value
                {
                    return dir.join(s.value());
                }
            }
        }
    }
    let stem = parent.file_stem().unwrap().to_str().unwrap();
    let base = if matches!(stem, "lib" | "mod" | "main") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    let flat = base.join(format!("{name}.rs"));
    if flat.exists() {
        flat
    } else {
        base.join(name).join("mod.rs")
    }
}

fn attrs_of(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Union(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

fn is_pub(vis: &syn::Visibility) -> bool {
    matches!(vis, syn::Visibility::Public(_))
}

/// `#[cfg(test)]` (or any `cfg` that needs `test`): not part of the API.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta
                .require_list()
                .map(|l| {
                    let t = l.tokens.to_string();
                    t == "test" || (t.starts_with("all") && t.contains("test"))
                })
                .unwrap_or(false)
    })
}

/// The attributes a line records: `#[doc(hidden)]`, `cfg`s,
/// `#[non_exhaustive]`, derives, `#[must_use]`.
fn item_marks(attrs: &[syn::Attribute]) -> Vec<String> {
    let mut marks = Vec::new();
    for a in attrs {
        let p = a.path();
        let text = || collapse(&a.meta.to_token_stream_string());
        if p.is_ident("doc") {
            if let syn::Meta::List(l) = &a.meta {
                if l.tokens.to_string() == "hidden" {
                    marks.push("#[doc(hidden)]".to_string());
                }
            }
        } else if p.is_ident("cfg")
            || p.is_ident("non_exhaustive")
            || p.is_ident("derive")
            || p.is_ident("must_use")
        {
            marks.push(format!("#[{}]", text()));
        }
    }
    marks
}

/// A token stream as text, without `quote` (not a dependency here).
trait TokenText {
    fn to_token_stream_string(&self) -> String;
}

impl TokenText for syn::Meta {
    fn to_token_stream_string(&self) -> String {
        match self {
            syn::Meta::Path(p) => path_text(p),
            syn::Meta::List(l) => format!("{}({})", path_text(&l.path), l.tokens),
            syn::Meta::NameValue(nv) => format!("{} = ..", path_text(&nv.path)),
        }
    }
}

fn path_text(p: &syn::Path) -> String {
    p.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

/// Whitespace runs as one space, and no space just inside brackets or
/// before a comma: a signature reads the same however rustfmt wrapped it.
fn collapse(text: &str) -> String {
    let mut out = String::new();
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    for (from, to) in [
        ("( ", "("),
        (" )", ")"),
        ("[ ", "["),
        (" ]", "]"),
        ("< ", "<"),
        (" >", ">"),
        (" ,", ","),
        (",)", ")"),
        (",>", ">"),
        (",]", "]"),
        (", }", " }"),
        (" ::", "::"),
        (":: ", "::"),
        (" ;", ";"),
    ] {
        while out.contains(from) {
            out = out.replace(from, to);
        }
    }
    out
}

/// The source text a syntax node spans, collapsed.
fn text_of(module: &Module, node: &impl Spanned) -> String {
    let range = node.span().byte_range();
    collapse(&module.source[range])
}

/// The text from the start of `from` to the end of `to`.
fn text_between(module: &Module, from: &impl Spanned, to: &impl Spanned) -> String {
    let start = from.span().byte_range().start;
    let end = to.span().byte_range().end;
    collapse(&module.source[start..end])
}

/// FNV-1a: a hash that is the same on every toolchain.
fn fnv(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn marks_text(marks: &[String]) -> String {
    if marks.is_empty() {
        String::new()
    } else {
        format!(" {}", marks.join(" "))
    }
}

/// What a public path names.
enum Target {
    /// Item `index` of module `module`.
    Item { module: usize, index: usize },
    /// A module.
    Module,
    /// Outside the crate (`nixl_agent::NixlStatus`), as written.
    External(String),
    /// Not found among the items: made by a macro in `module`.
    MacroMade { module: usize, name: String },
}

impl Crate {
    /// Resolves `segments`, written in module `from`, to what they name.
    fn resolve(&self, from: usize, segments: &[String], depth: usize) -> Target {
        assert!(depth < 32, "re-export cycle at {segments:?}");
        let (mut at, rest) = match segments[0].as_str() {
            "crate" => (0, &segments[1..]),
            "self" => (from, &segments[1..]),
            "super" => {
                let parent = self.parent(from);
                return self.resolve(
                    parent,
                    &std::iter::once("self".to_string())
                        .chain(segments[1..].iter().cloned())
                        .collect::<Vec<_>>(),
                    depth + 1,
                );
            }
            first => {
                // (`use etcd_client;` binds a name to the crate itself.)
                let bound_here = self
                    .binding(from, first)
                    .is_some_and(|path| path[0] != first);
                if self.modules[from].children.contains_key(first)
                    || bound_here
                    || self.item_named(from, first).is_some()
                {
                    (from, segments)
                } else {
                    return Target::External(segments.join("::"));
                }
            }
        };
        for (i, seg) in rest.iter().enumerate() {
            let last = i + 1 == rest.len();
            if let Some(&child) = self.modules[at].children.get(seg) {
                if last {
                    return Target::Module;
                }
                at = child;
                continue;
            }
            if let Some(index) = self.item_named(at, seg) {
                assert!(last, "a path through item {seg}: {segments:?}");
                return Target::Item { module: at, index };
            }
            if let Some(bound) = self.binding(at, seg) {
                let mut path = bound;
                path.extend(rest[i + 1..].iter().cloned());
                return self.resolve(at, &path, depth + 1);
            }
            return Target::MacroMade {
                module: at,
                name: seg.clone(),
            };
        }
        Target::Module
    }

    fn parent(&self, module: usize) -> usize {
        let mut path = self.modules[module].path.clone();
        path.pop();
        self.modules.iter().position(|m| m.path == path).unwrap()
    }

    /// The item (not a `use`) named `name` in `module`.
    fn item_named(&self, module: usize, name: &str) -> Option<usize> {
        self.modules[module]
            .items
            .iter()
            .position(|item| item_name(item).as_deref() == Some(name))
    }

    /// The path a `use` in `module` binds `name` to.
    fn binding(&self, module: usize, name: &str) -> Option<Vec<String>> {
        for item in &self.modules[module].items {
            if let syn::Item::Use(u) = item {
                for (bound, path) in use_bindings(&u.tree, Vec::new()) {
                    if bound == name {
                        return Some(path);
                    }
                }
            }
        }
        None
    }
}

fn item_name(item: &syn::Item) -> Option<String> {
    Some(match item {
        syn::Item::Const(i) => i.ident.to_string(),
        syn::Item::Enum(i) => i.ident.to_string(),
        syn::Item::Fn(i) => i.sig.ident.to_string(),
        syn::Item::Static(i) => i.ident.to_string(),
        syn::Item::Struct(i) => i.ident.to_string(),
        syn::Item::Trait(i) => i.ident.to_string(),
        syn::Item::Type(i) => i.ident.to_string(),
        syn::Item::Union(i) => i.ident.to_string(),
        syn::Item::Macro(i) => i.ident.as_ref()?.to_string(),
        _ => return None,
    })
}

/// Every (name bound, full path) of a `use` tree. Globs are not expected
/// in this workspace; one fails the test rather than going unrecorded.
fn use_bindings(tree: &syn::UseTree, prefix: Vec<String>) -> Vec<(String, Vec<String>)> {
    match tree {
        syn::UseTree::Path(p) => {
            let mut prefix = prefix;
            prefix.push(p.ident.to_string());
            use_bindings(&p.tree, prefix)
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                let bound = prefix.last().cloned().unwrap();
                return vec![(bound, prefix)];
            }
            let mut path = prefix;
            path.push(name.clone());
            vec![(name, path)]
        }
        syn::UseTree::Rename(r) => {
            let mut path = prefix;
            path.push(r.ident.to_string());
            vec![(r.rename.to_string(), path)]
        }
        syn::UseTree::Group(g) => g
            .items
            .iter()
            .flat_map(|t| use_bindings(t, prefix.clone()))
            .collect(),
        syn::UseTree::Glob(_) => panic!("a glob import ({prefix:?}::*): record its names by hand"),
    }
}

/// Every public path of the crate and what it names.
fn exports(krate: &Crate) -> Vec<(String, Target, Vec<String>)> {
    let mut out = Vec::new();
    for (m, module) in krate.modules.iter().enumerate() {
        // `#[macro_export]` puts a macro at the crate root from any module.
        for (index, item) in module.items.iter().enumerate() {
            if let syn::Item::Macro(mac) = item {
                if mac.attrs.iter().any(|a| a.path().is_ident("macro_export")) {
                    out.push((
                        format!("{}::{}", krate.name, mac.ident.as_ref().unwrap()),
                        Target::Item { module: m, index },
                        Vec::new(),
                    ));
                }
            }
        }
        if !module.public {
            continue;
        }
        let here = |name: &str| {
            let mut p = vec![krate.name.clone()];
            p.extend(module.path.iter().cloned());
            p.push(name.to_string());
            p.join("::")
        };
        for (index, item) in module.items.iter().enumerate() {
            let marks = {
                let mut v = module.marks.clone();
                v.extend(item_marks(attrs_of(item)));
                v
            };
            match item {
                syn::Item::Use(u) if is_pub(&u.vis) => {
                    for (bound, path) in use_bindings(&u.tree, Vec::new()) {
                        let target = krate.resolve(m, &path, 0);
                        out.push((here(&bound), target, marks.clone()));
                    }
                }
                syn::Item::Macro(_) => {}
                _ => {
                    let public = match item {
                        syn::Item::Const(i) => is_pub(&i.vis),
                        syn::Item::Enum(i) => is_pub(&i.vis),
                        syn::Item::Fn(i) => is_pub(&i.vis),
                        syn::Item::Static(i) => is_pub(&i.vis),
                        syn::Item::Struct(i) => is_pub(&i.vis),
                        syn::Item::Trait(i) => is_pub(&i.vis),
                        syn::Item::Type(i) => is_pub(&i.vis),
                        syn::Item::Union(i) => is_pub(&i.vis),
                        _ => false,
                    };
                    if public {
                        let name = item_name(item).unwrap();
                        out.push((here(&name), Target::Item { module: m, index }, marks));
                    }
                }
            }
        }
        for (name, &child) in &module.children {
            if krate.modules[child].public {
                out.push((
                    here(name),
                    Target::Module,
                    krate.modules[child].marks.clone(),
                ));
            }
        }
    }
    out
}

/// The listing of one crate: one line per item, sorted.
fn listing(krate: &Crate) -> BTreeSet<String> {
    let mut lines = BTreeSet::new();
    // Type names defined more than once: impls of those count only in the
    // defining module.
    let mut defined: HashMap<String, Vec<usize>> = HashMap::new();
    for (m, module) in krate.modules.iter().enumerate() {
        for item in &module.items {
            if let syn::Item::Struct(_) | syn::Item::Enum(_) | syn::Item::Union(_) = item {
                defined.entry(item_name(item).unwrap()).or_default().push(m);
            }
        }
    }
    for (path, target, marks) in exports(krate) {
        let marks_here = marks_text(&marks);
        match target {
            Target::External(p) => {
                lines.insert(format!("pub use {path} = {p}{marks_here}"));
            }
            Target::Module => {
                lines.insert(format!("pub mod {path}{marks_here}"));
            }
            Target::MacroMade { module, name } => {
                let m = &krate.modules[module];
                lines.insert(format!(
                    "pub use {path} = crate::{}{name} (made by a macro){marks_here}",
                    m.path.iter().map(|s| format!("{s}::")).collect::<String>()
                ));
                impls(krate, &defined, module, &name, &path, &mut lines);
            }
            Target::Item { module, index } => {
                let m = &krate.modules[module];
                let item = &m.items[index];
                // Marks of the defining item, where the path's own (a
                // re-export's) do not hold them.
                let mut all = marks.clone();
                for mark in item_marks(attrs_of(item)) {
                    if !all.contains(&mark) {
                        all.push(mark);
                    }
                }
                let marks_here = marks_text(&all);
                item_lines(
                    krate,
                    &defined,
                    module,
                    item,
                    &path,
                    &marks_here,
                    &mut lines,
                );
            }
        }
    }
    // Macros: definitions and item-level calls, hashed.
    for module in &krate.modules {
        for item in &module.items {
            if let syn::Item::Macro(mac) = item {
                let at = format!(
                    "{}{}",
                    krate.name,
                    module
                        .path
                        .iter()
                        .map(|s| format!("::{s}"))
                        .collect::<String>()
                );
                let text = text_of(module, &mac.mac);
                match &mac.ident {
                    Some(name) => {
                        lines.insert(format!("macro_rules! {name} in {at}: fnv {}", fnv(&text)))
                    }
                    None => lines.insert(format!(
                        "{}! called in {at}: fnv {}",
                        path_text(&mac.mac.path),
                        fnv(&text)
                    )),
                };
            }
        }
    }
    lines
}

fn item_lines(
    krate: &Crate,
    defined: &HashMap<String, Vec<usize>>,
    module: usize,
    item: &syn::Item,
    path: &str,
    marks: &str,
    lines: &mut BTreeSet<String>,
) {
    let m = &krate.modules[module];
    match item {
        syn::Item::Struct(s) => {
            let generics = text_of(m, &s.generics);
            let private = s.fields.iter().filter(|f| !is_pub(&f.vis)).count();
            let shape = match &s.fields {
                syn::Fields::Unit => "unit",
                syn::Fields::Unnamed(_) => "tuple",
                syn::Fields::Named(_) => "fields",
            };
            let private = if private > 0 { ", private fields" } else { "" };
            lines.insert(format!(
                "pub struct {path}{generics} ({shape}{private}){marks}"
            ));
            for (i, f) in s.fields.iter().enumerate() {
                if is_pub(&f.vis) {
                    let name = f.ident.as_ref().map_or(i.to_string(), |n| n.to_string());
                    lines.insert(format!(
                        "pub struct {path} field {name}: {}",
                        text_of(m, &f.ty)
                    ));
                }
            }
            impls(krate, defined, module, &s.ident.to_string(), path, lines);
        }
        syn::Item::Enum(e) => {
            lines.insert(format!("pub enum {path}{}{marks}", text_of(m, &e.generics)));
            for v in &e.variants {
                let fields: Vec<String> = v
                    .fields
                    .iter()
                    .map(|f| match &f.ident {
                        Some(n) => format!("{n}: {}", text_of(m, &f.ty)),
                        None => text_of(m, &f.ty),
                    })
                    .collect();
                let fields = match &v.fields {
                    syn::Fields::Unit => String::new(),
                    syn::Fields::Unnamed(_) => format!("({})", fields.join(", ")),
                    syn::Fields::Named(_) => format!(" {{ {} }}", fields.join(", ")),
                };
                lines.insert(format!(
                    "pub enum {path} variant {}{fields}{}",
                    v.ident,
                    marks_text(&item_marks(&v.attrs))
                ));
            }
            impls(krate, defined, module, &e.ident.to_string(), path, lines);
        }
        syn::Item::Union(u) => {
            lines.insert(format!("pub union {path}{marks}"));
            impls(krate, defined, module, &u.ident.to_string(), path, lines);
        }
        syn::Item::Fn(f) => {
            lines.insert(format!("pub {} (at {path}){marks}", text_of(m, &f.sig)));
        }
        syn::Item::Const(c) => {
            lines.insert(format!("pub const {path}: {}{marks}", text_of(m, &c.ty)));
        }
        syn::Item::Static(s) => {
            lines.insert(format!("pub static {path}: {}{marks}", text_of(m, &s.ty)));
        }
        syn::Item::Type(t) => {
            lines.insert(format!(
                "pub type {path}{} = {}{marks}",
                text_of(m, &t.generics),
                text_of(m, &t.ty)
            ));
        }
        syn::Item::Trait(t) => {
            let bounds = if t.supertraits.is_empty() {
                String::new()
            } else {
                format!(": {}", text_of(m, &t.supertraits))
            };
            lines.insert(format!(
                "pub trait {path}{}{bounds}{marks}",
                text_of(m, &t.generics)
            ));
            for ti in &t.items {
                let text = match ti {
                    syn::TraitItem::Fn(f) => {
                        let default = if f.default.is_some() {
                            " (provided)"
                        } else {
                            ""
                        };
                        format!("{}{default}", text_of(m, &f.sig))
                    }
                    syn::TraitItem::Type(ty) => text_of(m, ty),
                    syn::TraitItem::Const(c) => format!("const {}: {}", c.ident, text_of(m, &c.ty)),
                    other => text_of(m, other),
                };
                lines.insert(format!("pub trait {path} item {text}"));
            }
            impls(krate, defined, module, &t.ident.to_string(), path, lines);
        }
        syn::Item::Macro(mac) => {
            lines.insert(format!(
                "#[macro_export] macro_rules! {path}: fnv {}",
                fnv(&text_of(m, &mac.mac))
            ));
        }
        other => panic!(
            "{path}: an item of a kind this test does not record: {}",
            text_of(m, other)
        ),
    }
}

/// The impls of type `name` (defined in `module`), recorded under `path`.
fn impls(
    krate: &Crate,
    defined: &HashMap<String, Vec<usize>>,
    module: usize,
    name: &str,
    path: &str,
    lines: &mut BTreeSet<String>,
) {
    let unique = defined.get(name).is_none_or(|d| d.len() <= 1);
    for (m, module_here) in krate.modules.iter().enumerate() {
        if !unique && m != module {
            continue;
        }
        for item in &module_here.items {
            let syn::Item::Impl(imp) = item else { continue };
            let self_name = match &*imp.self_ty {
                syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
                _ => None,
            };
            let trait_name = imp
                .trait_
                .as_ref()
                .and_then(|(_, p, _)| p.segments.last().map(|s| s.ident.to_string()));
            let for_us = self_name.as_deref() == Some(name);
            if !for_us {
                continue;
            }
            let cfg = marks_text(&item_marks(&imp.attrs));
            let mut header = text_between(module_here, &imp.impl_token, &imp.self_ty);
            if let Some(w) = &imp.generics.where_clause {
                let _ = write!(header, " {}", text_of(module_here, w));
            }
            if trait_name.is_some() {
                lines.insert(format!("{path}: {header}{cfg}"));
                continue;
            }
            for ii in &imp.items {
                let (public, text) = match ii {
                    syn::ImplItem::Fn(f) => (is_pub(&f.vis), text_of(module_here, &f.sig)),
                    syn::ImplItem::Const(c) => (
                        is_pub(&c.vis),
                        format!("const {}: {}", c.ident, text_of(module_here, &c.ty)),
                    ),
                    syn::ImplItem::Type(t) => (
                        is_pub(&t.vis),
                        format!("type {} = {}", t.ident, text_of(module_here, &t.ty)),
                    ),
                    _ => (false, String::new()),
                };
                let item_attrs = match ii {
                    syn::ImplItem::Fn(f) => &f.attrs,
                    syn::ImplItem::Const(c) => &c.attrs,
                    syn::ImplItem::Type(t) => &t.attrs,
                    _ => continue,
                };
                if public && !is_test(item_attrs) {
                    let marks = marks_text(&item_marks(item_attrs));
                    lines.insert(format!("{path}: {header} {{ pub {text} }}{cfg}{marks}"));
                }
            }
        }
    }
}

/// The crates whose API is recorded, and where their listing is.
const CRATES: &[(&str, &str)] = &[
    ("nixl-keepalive", "."),
    ("nixl-sys", "nixl-sys"),
    ("nixl-agent", "nixl-sys/safe"),
    ("ucx-sys", "ucx-sys"),
    ("nixl-status", "status"),
];

#[test]
fn the_public_api_is_the_recorded_one() {
    let root = workspace();
    let update = std::env::var_os("UPDATE_API").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, dir) in CRATES {
        let krate = load(name, &root.join(dir));
        let lines = listing(&krate);
        let mut text = format!(
            "# The public API of {name}, one item a line (cli/tests/public_api.rs writes it:\n\
             # UPDATE_API=1 cargo test -p nixl-keepalive-cli --test public_api).\n"
        );
        for line in &lines {
            text.push_str(line);
            text.push('\n');
        }
        let file = root.join("api").join(format!("{name}.txt"));
        let recorded = fs::read_to_string(&file).unwrap_or_default();
        if recorded == text {
            continue;
        }
        if update {
            fs::create_dir_all(file.parent().unwrap()).unwrap();
            fs::write(&file, &text).unwrap();
            continue;
        }
        let was: BTreeSet<&str> = recorded.lines().collect();
        let now: BTreeSet<&str> = text.lines().collect();
        let mut diff = String::new();
        for gone in was.difference(&now) {
            let _ = writeln!(diff, "  - {gone}");
        }
        for new in now.difference(&was) {
            let _ = writeln!(diff, "  + {new}");
        }
        stale.push(format!(
            "{} (`-` recorded, `+` in the source):\n{diff}",
            file.display()
        ));
    }
    assert!(
        stale.is_empty(),
        "the public API changed; if on purpose, record it (and say so in CHANGELOG.md when it \
         breaks users):\n  UPDATE_API=1 cargo test -p nixl-keepalive-cli --test public_api\n\n{}",
        stale.join("\n")
    );
}

#[test]
fn the_listing_sees_what_the_api_promises() {
    // The check is only as good as what it sees: a few items it must find,
    // each a kind of line.
    let krate = load("nixl-keepalive", &workspace());
    let lines = listing(&krate);
    let has = |needle: &str| lines.iter().any(|l| l.contains(needle));
    assert!(has("pub enum nixl_keepalive::Event #[derive("), "Event");
    assert!(
        has("pub enum nixl_keepalive::Event variant Released {"),
        "Event's variants"
    );
    assert!(has("#[non_exhaustive]"), "non_exhaustive marks");
    assert!(
        has("nixl_keepalive::KeepaliveHandle: impl<") && has("{ pub fn peer_gone(&self, peer: PeerRef, mode: GoneMode) -> Result<(), ServiceStopped> }"),
        "a method's signature"
    );
    assert!(
        has("pub mod nixl_keepalive::text #[doc(hidden)]"),
        "hidden modules"
    );
    assert!(
        has("[cfg(feature = \"fake\")]") || has("#[cfg(feature = \"fake\")]"),
        "feature gates"
    );
    assert!(
        has("pub use nixl_keepalive::NixlStatus = nixl_status::NixlStatus"),
        "external re-exports"
    );
    assert!(
        has("pub use nixl_keepalive::EngineId = crate::names::EngineId (made by a macro)"),
        "macro-made names"
    );
    assert!(
        has("pub trait nixl_keepalive::Transport item fn notify("),
        "trait items"
    );
    assert!(
        has("nixl_keepalive::Event: impl std::fmt::Display for Event"),
        "trait impls"
    );
}
