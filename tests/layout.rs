//! The layout a reader relies on (issue 35): every file of the core's
//! rules stays short enough to read with nothing else open (a file that
//! grows past the limit is split by concern, not the limit raised), and
//! the core is sans-IO: it names nothing of tokio, so it builds without
//! the runtime (its clock is `std::time::Instant` values the driver hands
//! in).

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
