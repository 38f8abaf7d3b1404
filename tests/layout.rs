//! The layout a reader relies on (issues 35 and 46): the core's flow is
//! read in one file, each rule's file owns one rule and returns decisions,
//! functions are small, and the core is sans-IO: it names nothing of
//! tokio (its clock is `std::time::Instant` values the driver hands in),
//! no thread, lock, system call or read accounting of the driver's, and
//! neither does anything it imports from the rest of the crate, and it
//! builds without C or C++: no native binding in what it imports, and no
//! native build in the library's graph without its `nixl` feature.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The most lines a function of the core's own code may have, signature
/// and closing brace included: one screen. (It replaced a cap of 600
/// lines per file, which pushed the steps of one flow into different
/// files instead of making them smaller.)
const MAX_CORE_FN_LINES: usize = 60;

/// The files where `impl Core` may be written: the flow files, where the
/// flows that cross rules live, each whole in one file (`flow.rs`: time,
/// inputs, statuses, marks, releases, stalls and retirements; `claims.rs`:
/// the handshake flow, from a claim to an engine's first round), and
/// `mod.rs`, the core's types and its read-only entry points.
const CORE_IMPL_FILES: [&str; 3] = ["flow.rs", "claims.rs", "mod.rs"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The core's own files (its tests aside), each with its code (comments
/// and test module cut).
fn core_code() -> Vec<(PathBuf, Vec<String>)> {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    files.retain(|f| !f.starts_with(core.join("tests")));
    assert!(
        files.len() > 10,
        "the core's files were not found under {}",
        core.display()
    );
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let code = code_of(&f);
            (f, code)
        })
        .collect()
}

fn file_name(f: &Path) -> &str {
    f.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

/// Whether `word` appears in `line` as a whole identifier.
fn names(line: &str, word: &str) -> bool {
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

#[test]
fn impl_core_is_written_only_in_the_flow_file_and_mod_rs() {
    let mut elsewhere = Vec::new();
    for (f, code) in core_code() {
        if CORE_IMPL_FILES.contains(&file_name(&f)) {
            continue;
        }
        for (i, line) in code.iter().enumerate() {
            let line = line.trim_start();
            if line.starts_with("impl") && names(line, "Core") {
                elsewhere.push(format!("{}:{}: {line}", f.display(), i + 1));
            }
        }
    }
    assert!(
        elsewhere.is_empty(),
        "`impl Core` outside {CORE_IMPL_FILES:?}: a flow that crosses rules belongs in a flow file, a rule's own decision in a method of its state: {elsewhere:#?}"
    );
}

/// A rule's file holds the rule's state and decisions; it never reaches
/// another rule through `Core` (the flow file calls each rule and carries
/// its decision to the next).
#[test]
fn the_rules_files_do_not_name_core() {
    let mut uses = Vec::new();
    for (f, code) in core_code() {
        if CORE_IMPL_FILES.contains(&file_name(&f)) {
            continue;
        }
        for (i, line) in code.iter().enumerate() {
            if names(line, "Core") {
                uses.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(uses.is_empty(), "rule files naming `Core`: {uses:#?}");
}

/// Every function of the core's own code fits on a screen.
#[test]
fn every_function_of_the_core_fits_on_a_screen() {
    let mut long = Vec::new();
    for (f, code) in core_code() {
        let mut open: Option<(usize, String, String)> = None;
        for (i, line) in code.iter().enumerate() {
            let trimmed = line.trim_start();
            let indent = &line[..line.len() - trimmed.len()];
            if open.is_none() {
                let head = trimmed
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub(super) ")
                    .trim_start_matches("pub ")
                    .trim_start_matches("const ");
                if let Some(rest) = head.strip_prefix("fn ") {
                    let name = rest.split(['(', '<']).next().unwrap_or("").to_string();
                    open = Some((i, indent.to_string(), name));
                }
                if trimmed.ends_with(';') && open.as_ref().is_some_and(|o| o.0 == i) {
                    open = None; // a declaration without a body
                }
                continue;
            }
            let (start, fn_indent, name) = open.clone().expect("open");
            if line.trim_end() == format!("{fn_indent}}}") {
                let lines = i - start + 1;
                if lines > MAX_CORE_FN_LINES {
                    long.push(format!("{}: fn {name} ({lines} lines)", f.display()));
                }
                open = None;
            } else if i == start + 1 && trimmed.ends_with(';') && !line.contains('{') {
                open = None;
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions of src/core/ over {MAX_CORE_FN_LINES} lines: {long:?}; split them by step, not by file"
    );
}

/// Every file of the core says first what it owns.
#[test]
fn every_file_of_the_core_says_what_it_owns() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    let silent: Vec<String> = files
        .iter()
        .filter(|f| {
            !std::fs::read_to_string(f)
                .expect("read")
                .trim_start()
                .starts_with("//!")
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        silent.is_empty(),
        "files of src/core/ without a module doc saying what they own: {silent:?}"
    );
}

/// The core is sans-IO in the full sense: its own code names no thread,
/// lock, system call or atomic, and no part of the driver's read
/// accounting (it reads its counts through `ReadAccounting`, which the
/// driver implements with atomics and a `membarrier`). One exception,
/// named here: `rate.rs` keeps governor's one-slot state store in an
/// atomic that only the core's thread touches, because governor's store
/// is written through `&self` and the core must be `Send` (a `Cell`
/// would make it neither).
#[test]
fn the_core_names_no_thread_lock_system_call_or_atomic() {
    const FORBIDDEN: [&str; 12] = [
        "std::thread",
        "thread::spawn",
        "Mutex",
        "RwLock",
        "Condvar",
        "libc",
        "rustix",
        "membarrier",
        "syscall",
        "unsafe",
        "read_accounting",
        "EngineCell",
    ];
    let mut found = Vec::new();
    for (f, code) in core_code() {
        for (i, line) in code.iter().enumerate() {
            let atomic = line.contains("atomic") || line.contains("Atomic");
            let hits = FORBIDDEN.iter().any(|w| line.contains(w))
                || (atomic && file_name(&f) != "rate.rs");
            if hits {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "the core must stay sans-IO: {found:#?}");
    // The core's tests drive it over the plain accounting, never the
    // driver's cells.
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core/tests");
    let mut files = Vec::new();
    rust_files(&tests, &mut files);
    let real = lines_naming(&files, |code| {
        code.contains("EngineCell") || code.contains("read_accounting")
    });
    assert!(
        real.is_empty(),
        "the core's tests must run over the plain accounting: {real:#?}"
    );
}

#[test]
fn the_core_names_nothing_of_tokio() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    let uses = lines_naming(&files, |code| code.contains("tokio"));
    assert!(
        uses.is_empty(),
        "the core must not depend on tokio (take `now` from the driver instead): {uses:#?}"
    );
}

/// The lines of `files` whose code (comments cut) `names` picks, as
/// `path:line: text`.
fn lines_naming(files: &[PathBuf], names: impl Fn(&str) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).expect("read");
        for (i, line) in text.lines().enumerate() {
            if names(line.split("//").next().unwrap_or("")) {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    found
}

/// A file's code, without its comments and its test module (the part from
/// a `#[cfg(test)]` followed by a `mod` on: tests may use the runtime).
fn code_of(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    let mut code = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let next = lines.get(i + 1).map(|l| l.trim_start()).unwrap_or("");
        if line.trim() == "#[cfg(test)]" && (next.starts_with("mod ") || next.contains(" mod ")) {
            break;
        }
        code.push(line.split("//").next().unwrap_or("").to_string());
    }
    code
}

/// The file that defines module path `parts` under `src/` (the longest
/// prefix that is a file: `crate::transport::PeerAddr` is
/// `src/transport/mod.rs`).
fn module_file(src: &Path, parts: &[&str]) -> Option<PathBuf> {
    (1..=parts.len()).rev().find_map(|n| {
        let dir = parts[..n]
            .iter()
            .fold(src.to_path_buf(), |p, part| p.join(part));
        [dir.with_extension("rs"), dir.join("mod.rs")]
            .into_iter()
            .find(|f| f.is_file())
    })
}

/// The paths a file names: `crate::a::b` anywhere in its code, and, in a
/// `mod.rs`, the children it re-exports from (`pub use names::PeerAddr`).
fn named_files(src: &Path, file: &Path, code: &[String]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in code {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let path: Vec<&str> = rest
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .next()
                .unwrap_or("")
                .split("::")
                .filter(|p| !p.is_empty() && p.chars().next().is_some_and(|c| c.is_lowercase()))
                .collect();
            if let Some(f) = module_file(src, &path) {
                out.push(f);
            }
        }
        if file.file_name().is_some_and(|n| n == "mod.rs") {
            if let Some(child) = line.trim().strip_prefix("pub use ") {
                let child = child.split("::").next().unwrap_or("");
                let dir = file.parent().expect("a mod.rs has a folder");
                for f in [
                    dir.join(format!("{child}.rs")),
                    dir.join(child).join("mod.rs"),
                ] {
                    if f.is_file() {
                        out.push(f);
                    }
                }
            }
        }
    }
    out
}

/// The native bindings: crates that build or load C and C++ (`nixl-sys`
/// compiles a C++ shim and C interposers; `ucx-sys` loads UCX), as code
/// names them.
const NATIVE_BINDINGS: [&str; 3] = ["nixl_agent", "nixl_sys", "ucx_sys"];

/// What the core imports from the rest of the crate (followed from file to
/// file) names nothing of tokio either, nor a native binding: the core
/// built apart from the driver would need neither the runtime nor a C
/// compiler (its statuses are `nixl_status`'s plain tables). A module's
/// other children are not followed (`transport/resolve.rs` looks addresses
/// up on the runtime; the core names none of it).
#[test]
fn nothing_the_core_imports_names_tokio_or_a_native_binding() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut todo = Vec::new();
    rust_files(&src.join("core"), &mut todo);
    let mut seen: BTreeSet<PathBuf> = todo.iter().cloned().collect();
    let mut uses = Vec::new();
    while let Some(file) = todo.pop() {
        let code = code_of(&file);
        for (i, line) in code.iter().enumerate() {
            if line.contains("tokio") || NATIVE_BINDINGS.iter().any(|n| line.contains(n)) {
                uses.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
        for named in named_files(&src, &file, &code) {
            if seen.insert(named.clone()) {
                todo.push(named);
            }
        }
    }
    let reached: Vec<String> = seen
        .iter()
        .filter(|f| !f.starts_with(src.join("core")))
        .map(|f| {
            f.strip_prefix(&src)
                .expect("under src")
                .display()
                .to_string()
        })
        .collect();
    for expected in ["names.rs", "config.rs", "registration.rs"] {
        assert!(
            reached.iter().any(|r| r == expected),
            "the walk did not reach {expected} (reached: {reached:?}): the import walk is broken"
        );
    }
    assert!(
        uses.is_empty(),
        "what the core imports must name neither tokio nor a native binding: {uses:#?} (reached from src/core/: {reached:?})"
    );
    assert!(
        !reached.iter().any(|r| r.starts_with("read_accounting")),
        "the core reaches the driver's read accounting: {reached:?}"
    );
}

/// Runs cargo in the workspace and returns what it printed.
fn cargo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO"))
        .args(args)
        .args(["--offline", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The packages of the library's graph without its `nixl` feature (what
/// the core, the service and the fake build on), normal and build edges,
/// as `name version`, each with the native library it declares it links
/// (its manifest's `links`, from `cargo metadata`), if any.
fn graph_without_nixl() -> Vec<(String, Option<String>)> {
    let tree = cargo(&[
        "tree",
        "-p",
        "nixl-keepalive",
        "--no-default-features",
        "-e",
        "normal,build",
        "--prefix",
        "none",
        "--format",
        "{p}",
    ]);
    let meta: serde_json::Value =
        serde_json::from_str(&cargo(&["metadata", "--format-version", "1"])).expect("json");
    let links = |name: &str, version: &str| {
        meta["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .find(|p| p["name"] == name && p["version"] == version)
            .and_then(|p| p["links"].as_str().map(str::to_string))
    };
    let mut graph: Vec<(String, Option<String>)> = tree
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let (name, version) = (words.next()?, words.next()?.trim_start_matches('v'));
            Some((format!("{name} {version}"), links(name, version)))
        })
        .collect();
    graph.sort();
    graph.dedup();
    graph
}

/// The core builds, tests and fuzzes without compiling C or C++: in the
/// library's graph without `nixl`, no package links a native library
/// (declares `links`) and none of the native bindings or the build tools
/// of one (`cc`, `cmake`, `bindgen`, `pkg-config`) appears, build
/// dependencies included. The statuses come from `nixl-status`, which has
/// neither a dependency nor a build script.
#[test]
fn the_core_s_crate_graph_has_no_native_build() {
    let graph = graph_without_nixl();
    let name = |p: &str| p.split(' ').next().unwrap_or("").to_string();
    // The check sees what it looks for: the graph is there.
    for present in ["nixl-keepalive", "nixl-status", "governor", "tokio"] {
        assert!(
            graph.iter().any(|(p, _)| name(p) == present),
            "{present} missing from the graph: {graph:#?}"
        );
    }
    const NATIVE: [&str; 7] = [
        "nixl-sys",
        "nixl-agent",
        "ucx-sys",
        "cc",
        "cmake",
        "bindgen",
        "pkg-config",
    ];
    let native: Vec<&(String, Option<String>)> = graph
        .iter()
        .filter(|(p, links)| links.is_some() || NATIVE.contains(&name(p).as_str()))
        .collect();
    assert!(
        native.is_empty(),
        "the core's graph builds native code (package, links): {native:#?}"
    );
    // And the check would see one: with `nixl`, nixl-sys is there and
    // declares the shim it links.
    let with_nixl = cargo(&[
        "tree",
        "-p",
        "nixl-keepalive",
        "-e",
        "normal",
        "--prefix",
        "none",
    ]);
    assert!(with_nixl.contains("nixl-sys"), "{with_nixl}");
}
