//! The layout a reader relies on (issue 35): every file of the core's
//! rules stays short enough to read with nothing else open (a file that
//! grows past the limit is split by concern, not the limit raised), and
//! the core is sans-IO: it names nothing of tokio, so it builds without
//! the runtime (its clock is `std::time::Instant` values the driver hands
//! in), and neither does anything it imports from the rest of the crate.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The most lines a file under `src/core/` may have.
const MAX_CORE_FILE_LINES: usize = 600;

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

#[test]
fn no_file_of_the_core_passes_six_hundred_lines() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    assert!(
        files.len() > 10,
        "the core's files were not found under {}",
        core.display()
    );
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).expect("read").lines().count();
            (lines > MAX_CORE_FILE_LINES).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files of src/core/ over {MAX_CORE_FILE_LINES} lines: {long:?}; split them by concern"
    );
}

#[test]
fn the_core_names_nothing_of_tokio() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    let mut uses = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("tokio") {
                uses.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        uses.is_empty(),
        "the core must not depend on tokio (take `now` from the driver instead): {uses:#?}"
    );
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

/// What the core imports from the rest of the crate (followed from file to
/// file) names nothing of tokio either: the core built apart from the
/// driver would not need the runtime. A module's other children are not
/// followed (`transport/resolve.rs` looks addresses up on the runtime; the
/// core names none of it).
#[test]
fn nothing_the_core_imports_names_tokio() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut todo = Vec::new();
    rust_files(&src.join("core"), &mut todo);
    let mut seen: BTreeSet<PathBuf> = todo.iter().cloned().collect();
    let mut uses = Vec::new();
    while let Some(file) = todo.pop() {
        let code = code_of(&file);
        for (i, line) in code.iter().enumerate() {
            if line.contains("tokio") {
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
    for expected in ["read_accounting/cell.rs", "transport/names.rs", "config.rs"] {
        assert!(
            reached.iter().any(|r| r == expected),
            "the walk did not reach {expected} (reached: {reached:?}): the import walk is broken"
        );
    }
    assert!(
        uses.is_empty(),
        "what the core imports must not depend on tokio: {uses:#?} (reached from src/core/: {reached:?})"
    );
}
