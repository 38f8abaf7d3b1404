//! No module cycle in any crate of the workspace: the check `cargo modules
//! dependencies --acyclic` makes, as a plain test with nothing to install.
//!
//! A cycle between two modules means neither can be read, tested or moved
//! without the other: they are one module in two files. The check parses
//! the source (with `syn`), builds the module tree of every crate root of
//! every workspace member (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`),
//! and fails naming each cycle with the path that makes each of its edges.
//!
//! # What counts as a cycle
//! A module depends on another when its code names a path into it (a
//! `use`, a type, an expression, a pattern, a path inside a macro call).
//! Dependencies between a module and its own ancestors or descendants are
//! left out: a child using its parent's items (`super::Thing`) and a
//! parent using its children's (`mod.rs` re-exporting, calling into
//! them) are how a module and its parts work together. Every other
//! dependency, from `a::x::y` to `b::z`, is lifted to the two siblings
//! under the modules' lowest common ancestor (`a` depends on `b`). The
//! rule: **under each module, its child modules form a DAG**. So
//! `demo::decoder` -> `demo::report` -> `demo::decoder` is a cycle, and so
//! is `a::x` -> `b` -> `a` (through `a`'s root items).
//!
//! # How paths resolve
//! In module `m`, a path's first segment is `crate` (the crate root),
//! `self` (`m`), `super` (repeatable), a child module of `m`, or a name
//! that a `use` in `m` binds (the `use` path is then substituted and
//! resolved in `m`). Anything else (another crate, the prelude, a local
//! item, a generic parameter) names no module of this crate and makes no
//! dependency. Later segments walk down child modules; where a segment is
//! a name a `use` in the module reached binds (a re-export, `pub` or not:
//! children see their ancestors' imports), the `use` is followed, so
//! `super::Thing` re-exported from a sibling counts as a dependency on
//! that sibling, not on the parent.
//!
//! # Limits
//! - A module under `#[cfg(test)]` makes no dependency (as `cargo
//!   modules` leaves test code out unless asked): a unit test may use a
//!   test helper from anywhere in its crate. Other `cfg`s are ignored:
//!   every module is walked whatever the features, the stricter choice.
//! - A `use` inside a function body is taken as the module's own.
//! - Glob imports (`use a::*`) make a dependency on `a` but names brought
//!   in by them are not resolved.
//! - Paths inside macro calls are found by scanning their tokens for
//!   `ident :: ident ...` runs; a path a macro builds from pieces, or a
//!   bare name a macro uses, is not seen. Macros defined by `macro_rules!`
//!   are not expanded.
//! - `#[path = "..."]` on a module is honoured; `include!` is not followed.
//! - Every `.rs` file under a member's `src/` must be reached from a crate
//!   root, so a file the walk missed fails the test instead of going
//!   unchecked.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::spanned::Spanned;
use syn::visit::Visit;

/// One module of one crate.
#[derive(Debug)]
struct Module {
    /// `crate::a::b` as segments after `crate`.
    path: Vec<String>,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// Names bound by `use` in this module, to the path as written.
    bindings: HashMap<String, Vec<String>>,
    /// Paths this module names: segments, and where (`file:line`).
    refs: Vec<(Vec<String>, String)>,
    /// Under `#[cfg(test)]`: its paths make no dependency.
    test_only: bool,
}

/// The module tree of one crate root.
#[derive(Debug, Default)]
struct Crate {
    name: String,
    modules: Vec<Module>,
    files: BTreeSet<PathBuf>,
    errors: Vec<String>,
}

impl Crate {
    fn load(name: &str, root: &Path) -> Crate {
        let mut krate = Crate {
            name: name.to_string(),
            ..Crate::default()
        };
        krate.modules.push(Module {
            path: Vec::new(),
            parent: None,
            children: BTreeMap::new(),
            bindings: HashMap::new(),
            refs: Vec::new(),
            test_only: false,
        });
        let dir = root.parent().unwrap().to_path_buf();
        krate.load_file(0, root, &dir);
        krate
    }

    /// Parses `file` as the body of module `m`, whose child module files
    /// live in `dir`.
    fn load_file(&mut self, m: usize, file: &Path, dir: &Path) {
        let text = match fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                self.errors.push(format!("{}: {e}", file.display()));
                return;
            }
        };
        self.files.insert(file.to_path_buf());
        let parsed = match syn::parse_file(&text) {
            Ok(p) => p,
            Err(e) => {
                self.errors.push(format!("{}: {e}", file.display()));
                return;
            }
        };
        self.load_items(m, &parsed.items, file, dir);
    }

    fn load_items(&mut self, m: usize, items: &[syn::Item], file: &Path, dir: &Path) {
        for item in items {
            if let syn::Item::Mod(module) = item {
                self.load_mod(m, module, file, dir);
            } else {
                let mut walker = Walker {
                    krate: self,
                    module: m,
                    file,
                    dir,
                };
                walker.visit_item(item);
            }
        }
    }

    fn load_mod(&mut self, parent: usize, module: &syn::ItemMod, file: &Path, dir: &Path) {
        let name = module.ident.to_string();
        let mut path = self.modules[parent].path.clone();
        path.push(name.clone());
        let m = self.modules.len();
        let test_only = self.modules[parent].test_only
            || module.attrs.iter().any(|a| {
                a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
            });
        self.modules.push(Module {
            path,
            parent: Some(parent),
            children: BTreeMap::new(),
            bindings: HashMap::new(),
            refs: Vec::new(),
            test_only,
        });
        self.modules[parent].children.insert(name.clone(), m);
        let child_dir = dir.join(&name);
        if let Some((_, items)) = &module.content {
            // Walk the attributes (`#[cfg(...)]`) as the parent's.
            self.load_items(m, items, file, &child_dir);
            return;
        }
        let explicit = module.attrs.iter().find_map(|a| match &a.meta {
            syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => Some(s.value()),
                _ => None,
            },
            _ => None,
        });
        let (target, target_dir) = match explicit {
            Some(p) => {
                let t = file.parent().unwrap().join(p);
                let d = t.parent().unwrap().to_path_buf();
                (t, d)
            }
            None => {
                let flat = dir.join(format!("{name}.rs"));
                if flat.exists() {
                    (flat, child_dir)
                } else {
                    (child_dir.join("mod.rs"), child_dir)
                }
            }
        };
        self.load_file(m, &target, &target_dir);
    }

    /// Resolves `segs` named in module `m` to the module it points into.
    fn resolve(&self, m: usize, segs: &[String], depth: usize) -> Option<usize> {
        if segs.is_empty() || depth > 16 {
            return None;
        }
        let mut cur = m;
        let mut i = 0;
        match segs[0].as_str() {
            "crate" => {
                cur = 0;
                i = 1;
            }
            "self" => i = 1,
            "super" => {
                while i < segs.len() && segs[i] == "super" {
                    cur = self.modules[cur].parent?;
                    i += 1;
                }
            }
            "Self" => return None,
            first => {
                if let Some(&c) = self.modules[m].children.get(first) {
                    cur = c;
                    i = 1;
                } else if let Some(bound) = self.modules[m].bindings.get(first) {
                    let mut path = bound.clone();
                    path.extend_from_slice(&segs[1..]);
                    return self.resolve(m, &path, depth + 1);
                } else {
                    return None;
                }
            }
        }
        while i < segs.len() {
            if let Some(&c) = self.modules[cur].children.get(&segs[i]) {
                cur = c;
                i += 1;
                continue;
            }
            if let Some(bound) = self.modules[cur].bindings.get(&segs[i]) {
                // A re-export: depend on where it comes from.
                let mut path = bound.clone();
                path.extend_from_slice(&segs[i + 1..]);
                if let Some(t) = self.resolve(cur, &path, depth + 1) {
                    return Some(t);
                }
            }
            break;
        }
        Some(cur)
    }

    fn ancestors(&self, mut m: usize) -> Vec<usize> {
        let mut chain = vec![m];
        while let Some(p) = self.modules[m].parent {
            chain.push(p);
            m = p;
        }
        chain.reverse();
        chain
    }

    fn name(&self, m: usize) -> String {
        let mut s = String::from("crate");
        for seg in &self.modules[m].path {
            s.push_str("::");
            s.push_str(seg);
        }
        s
    }

    /// The cycles among siblings, each as lines naming its edges.
    fn cycles(&self) -> Vec<String> {
        // (from, to) siblings -> an example of a path making the edge.
        let mut edges: BTreeMap<(usize, usize), String> = BTreeMap::new();
        for (m, module) in self.modules.iter().enumerate() {
            if module.test_only {
                continue;
            }
            for (segs, at) in &module.refs {
                let Some(t) = self.resolve(m, segs, 0) else {
                    continue;
                };
                let (from, to) = (self.ancestors(m), self.ancestors(t));
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                if common == from.len() || common == to.len() {
                    continue; // an ancestor or a descendant
                }
                edges
                    .entry((from[common], to[common]))
                    .or_insert_with(|| format!("{} at {at}", segs.join("::")));
            }
        }
        let mut graph: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &(a, b) in edges.keys() {
            graph.entry(a).or_default().push(b);
        }
        let mut found = Vec::new();
        for scc in strongly_connected(&graph) {
            if scc.len() < 2 {
                continue;
            }
            let cycle = cycle_in(&graph, &scc);
            let mut text = format!(
                "{}: {}",
                self.name,
                cycle
                    .iter()
                    .chain(cycle.first())
                    .map(|&m| self.name(m))
                    .collect::<Vec<_>>()
                    .join(" -> ")
            );
            for w in cycle
                .windows(2)
                .chain(std::iter::once(&[*cycle.last().unwrap(), cycle[0]][..]))
            {
                text.push_str(&format!(
                    "\n    {} -> {}: {}",
                    self.name(w[0]),
                    self.name(w[1]),
                    edges[&(w[0], w[1])]
                ));
            }
            found.push(text);
        }
        found
    }
}

/// Tarjan's strongly connected components.
fn strongly_connected(graph: &BTreeMap<usize, Vec<usize>>) -> Vec<Vec<usize>> {
    struct State<'a> {
        graph: &'a BTreeMap<usize, Vec<usize>>,
        index: HashMap<usize, usize>,
        low: HashMap<usize, usize>,
        stack: Vec<usize>,
        on_stack: BTreeSet<usize>,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in s.graph.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
            if !s.index.contains_key(&w) {
                visit(s, w);
                let l = s.low[&v].min(s.low[&w]);
                s.low.insert(v, l);
            } else if s.on_stack.contains(&w) {
                let l = s.low[&v].min(s.index[&w]);
                s.low.insert(v, l);
            }
        }
        if s.low[&v] == s.index[&v] {
            let mut scc = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(&w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(scc);
        }
    }
    let mut s = State {
        graph,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !s.index.contains_key(&v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One simple cycle through the smallest node of a strongly connected
/// component (a breadth-first search back to it).
fn cycle_in(graph: &BTreeMap<usize, Vec<usize>>, scc: &[usize]) -> Vec<usize> {
    let members: BTreeSet<usize> = scc.iter().copied().collect();
    let start = *members.iter().next().unwrap();
    let mut came_from: HashMap<usize, usize> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in graph.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
            if !members.contains(&w) {
                continue;
            }
            if w == start {
                let mut path = vec![v];
                let mut at = v;
                while at != start {
                    at = came_from[&at];
                    path.push(at);
                }
                path.reverse();
                return path;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = came_from.entry(w) {
                e.insert(v);
                queue.push_back(w);
            }
        }
    }
    scc.to_vec()
}

/// Collects the paths of one module's items (not its child modules').
struct Walker<'a> {
    krate: &'a mut Crate,
    module: usize,
    file: &'a Path,
    dir: &'a Path,
}

impl Walker<'_> {
    fn at(&self, span: proc_macro2::Span) -> String {
        format!("{}:{}", self.file.display(), span.start().line)
    }

    fn add(&mut self, segs: Vec<String>, at: String) {
        self.krate.modules[self.module].refs.push((segs, at));
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.to_string();
                let mut full = prefix.clone();
                if name != "self" {
                    full.push(name.clone());
                }
                let bound = if name == "self" {
                    prefix.last().cloned().unwrap_or_default()
                } else {
                    name
                };
                let at = self.at(n.ident.span());
                self.bind(bound, full, at);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                if r.ident != "self" {
                    full.push(r.ident.to_string());
                }
                let at = self.at(r.ident.span());
                self.bind(r.rename.to_string(), full, at);
            }
            syn::UseTree::Glob(g) => {
                let at = self.at(g.star_token.span());
                self.add(prefix.clone(), at);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    fn bind(&mut self, name: String, full: Vec<String>, at: String) {
        let module = &mut self.krate.modules[self.module];
        if name != "_" {
            module.bindings.entry(name).or_insert_with(|| full.clone());
        }
        module.refs.push((full, at));
    }

    /// `a::b::c` runs of identifiers in a macro call's tokens.
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let mut run: Vec<String> = Vec::new();
        let mut colons = 0;
        let mut start = None;
        let flush = |w: &mut Self, run: &mut Vec<String>, start: &mut Option<String>| {
            if run.len() > 1 {
                w.add(std::mem::take(run), start.take().unwrap_or_default());
            }
            run.clear();
            *start = None;
        };
        for tt in tokens {
            match tt {
                TokenTree::Ident(ident) if colons == 2 || run.is_empty() => {
                    if run.is_empty() {
                        start = Some(self.at(ident.span()));
                    }
                    run.push(ident.to_string());
                    colons = 0;
                }
                TokenTree::Punct(p) if p.as_char() == ':' && !run.is_empty() && colons < 2 => {
                    colons += 1;
                }
                TokenTree::Group(g) => {
                    flush(self, &mut run, &mut start);
                    colons = 0;
                    self.scan_tokens(g.stream());
                }
                TokenTree::Ident(ident) => {
                    flush(self, &mut run, &mut start);
                    start = Some(self.at(ident.span()));
                    run.push(ident.to_string());
                    colons = 0;
                }
                _ => {
                    flush(self, &mut run, &mut start);
                    colons = 0;
                }
            }
        }
        flush(self, &mut run, &mut start);
    }
}

impl<'ast> Visit<'ast> for Walker<'_> {
    fn visit_item_mod(&mut self, module: &'ast syn::ItemMod) {
        // A module declared inside a function body.
        let (file, dir) = (self.file.to_path_buf(), self.dir.to_path_buf());
        self.krate.load_mod(self.module, module, &file, &dir);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut prefix = Vec::new();
        if item.leading_colon.is_some() {
            return; // `::other_crate::...`
        }
        self.use_tree(&mut prefix, &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() && path.segments.len() > 1 {
            let segs = path.segments.iter().map(|s| s.ident.to_string()).collect();
            let at = self.at(path.span());
            self.add(segs, at);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.scan_tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }
}

/// The workspace's members, from the root manifest's `members = [...]`.
fn members(root: &Path) -> Vec<PathBuf> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("the workspace manifest lists its members on one line");
    let list = &line[line.find('[').unwrap() + 1..line.rfind(']').unwrap()];
    list.split(',')
        .map(|s| s.trim().trim_matches('"'))
        .filter(|s| !s.is_empty())
        .map(|s| {
            if s == "." {
                root.to_path_buf()
            } else {
                root.join(s)
            }
        })
        .collect()
}

/// A member's package name (the first `name = "..."` of its manifest).
fn package_name(member: &Path) -> String {
    let manifest = fs::read_to_string(member.join("Cargo.toml")).unwrap_or_default();
    manifest
        .lines()
        .find_map(|l| {
            let rest = l
                .trim()
                .strip_prefix("name")?
                .trim_start()
                .strip_prefix('=')?;
            Some(rest.trim().trim_matches('"').to_string())
        })
        .unwrap_or_else(|| member.display().to_string())
}

/// The crate roots of a member: `src/lib.rs`, `src/main.rs`,
/// `src/bin/*.rs`.
fn roots(member: &Path) -> Vec<PathBuf> {
    let src = member.join("src");
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .filter(|p| p.exists())
        .collect();
    if let Ok(bins) = fs::read_dir(src.join("bin")) {
        for bin in bins.flatten() {
            if bin.path().extension().is_some_and(|e| e == "rs") {
                roots.push(bin.path());
            }
        }
    }
    roots
}

fn rust_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.insert(p);
        }
    }
}

/// Checks every crate of the workspace at `root`: cycles, then files no
/// root reached, then files that did not parse.
fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for member in members(root) {
        let mut reached = BTreeSet::new();
        for crate_root in roots(&member) {
            let name = format!(
                "{} ({})",
                package_name(&member),
                crate_root.strip_prefix(&member).unwrap().display()
            );
            let krate = Crate::load(&name, &crate_root);
            problems.extend(krate.errors.iter().cloned());
            problems.extend(krate.cycles());
            reached.extend(krate.files);
        }
        let mut all = BTreeSet::new();
        rust_files(&member.join("src"), &mut all);
        for missed in all.difference(&reached) {
            problems.push(format!(
                "{}: not reached from any crate root, so not checked",
                missed.display()
            ));
        }
    }
    problems
}

/// Cycles known and owned elsewhere, by their first line: each must still
/// be found (a fixed one fails the test until it is taken off this list),
/// and no other may appear. None today (`core` <-> `engine` went when
/// `GiveUp` moved to its own leaf module).
const KNOWN: &[&str] = &[];

#[test]
fn no_module_of_the_workspace_is_in_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let problems = check(root);
    let first = |p: &String| p.lines().next().unwrap_or("").to_string();
    let unknown: Vec<&String> = problems
        .iter()
        .filter(|p| !KNOWN.contains(&first(p).as_str()))
        .collect();
    let gone: Vec<&&str> = KNOWN
        .iter()
        .filter(|k| !problems.iter().any(|p| first(p) == **k))
        .collect();
    for p in &problems {
        eprintln!("{p}");
    }
    assert!(
        unknown.is_empty(),
        "module cycles (siblings must form a DAG; see this test's docs):\n{}",
        unknown
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        gone.is_empty(),
        "known cycles no longer found: take them off KNOWN: {gone:?}"
    );
}

/// Checks a throw-away workspace with the given files.
fn check_files(name: &str, files: &[(&str, &str)]) -> Vec<String> {
    let dir = workspace(name, files);
    let problems = check(&dir);
    let _ = fs::remove_dir_all(&dir);
    problems
}

/// A throw-away workspace with the given files.
fn workspace(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("module-cycles-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("Cargo.toml"), "[workspace]\nmembers = [\"k\"]\n").unwrap();
    for (path, text) in files {
        let p = dir.join("k").join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    dir
}

#[test]
fn two_siblings_using_each_other_are_a_cycle_named_with_its_paths() {
    let problems = check_files(
        "siblings",
        &[
            ("src/lib.rs", "mod demo;"),
            ("src/demo.rs", "mod decoder;\nmod report;"),
            (
                "src/demo/decoder.rs",
                "use super::report::Timeline;\npub struct Audit;",
            ),
            (
                "src/demo/report.rs",
                "pub struct Timeline;\nfn f(_: &super::decoder::Audit) {}",
            ),
        ],
    );
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let p = &problems[0];
    assert!(
        p.contains("crate::demo::decoder -> crate::demo::report -> crate::demo::decoder"),
        "{p}"
    );
    assert!(p.contains("super::report::Timeline at "), "{p}");
    assert!(p.contains("decoder.rs:1"), "{p}");
    assert!(p.contains("super::decoder::Audit at "), "{p}");
}

#[test]
fn a_child_using_its_parent_and_a_parent_using_its_child_are_no_cycle() {
    let problems = check_files(
        "family",
        &[
            ("src/lib.rs", "mod a;\nmod b;\npub struct Config;"),
            (
                "src/a.rs",
                "mod x;\npub use x::Thing;\nfn f(_: crate::Config) {}",
            ),
            (
                "src/a/x.rs",
                "pub struct Thing;\nfn g(_: super::super::Config) {}",
            ),
            ("src/b.rs", "fn h(_: crate::a::Thing) {}"),
        ],
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn a_cycle_through_a_re_export_or_a_macro_is_found() {
    // `b` uses `a`'s re-export of `a::x::Thing`, `a::x` uses `b` inside a
    // macro call: a -> b -> a.
    let problems = check_files(
        "hidden",
        &[
            ("src/lib.rs", "mod a;\nmod b;\nuse a::Thing as Renamed;"),
            ("src/a.rs", "mod x;\npub use x::Thing;"),
            (
                "src/a/x.rs",
                "pub struct Thing;\nfn g() { println!(\"{}\", crate::b::NAME); }",
            ),
            (
                "src/b.rs",
                "pub const NAME: &str = \"b\";\nfn h(_: crate::Renamed) {}",
            ),
        ],
    );
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0].contains("crate::a -> crate::b -> crate::a"),
        "{problems:#?}"
    );
}

#[test]
fn a_file_no_root_reaches_fails_the_check() {
    let problems = check_files(
        "orphan",
        &[
            ("src/lib.rs", "mod a;"),
            ("src/a.rs", ""),
            ("src/lost.rs", ""),
        ],
    );
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0].contains("lost.rs: not reached"),
        "{problems:#?}"
    );
}
