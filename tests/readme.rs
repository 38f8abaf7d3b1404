//! The README stays true: it opens with the two commands, and its table
//! lists every knob the service reads, with its default.

use nixl_keepalive::config::{KNOBS, NOT_SERVICE_KNOBS};

const README: &str = include_str!("../README.md");

#[test]
fn the_readme_opens_with_the_demo_and_the_test_command() {
    let block: Vec<&str> = README
        .lines()
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take(2)
        .collect();
    assert!(
        block[0].starts_with("cargo run --release -- demo"),
        "{block:?}"
    );
    assert!(block[1].starts_with("bash scripts/test.sh"), "{block:?}");
    assert!(std::path::Path::new("scripts/test.sh").exists());
}

#[test]
fn every_knob_is_in_the_readme_table_with_its_default() {
    for knob in KNOBS {
        let row = README
            .lines()
            .find(|l| l.starts_with(&format!("| `{}` |", knob.env)))
            .unwrap_or_else(|| panic!("{} has no row in the README table", knob.env));
        // The default column starts with the default (a derived one may
        // be followed by what it comes to at the default interval).
        assert!(
            row.contains(&format!("| `{}` |", knob.default))
                || row.contains(&format!("| `{}` (", knob.default)),
            "{}: README row does not show the default {}: {row}",
            knob.env,
            knob.default
        );
        // The syntax column is the knob's syntax, bounds included.
        assert!(
            row.contains(&format!("| {} |", knob.syntax)),
            "{}: README row does not show the syntax and range {}: {row}",
            knob.env,
            knob.syntax
        );
    }
    for var in NOT_SERVICE_KNOBS {
        assert!(README.contains(&format!("| `{var}` |")), "{var} missing");
    }
}
