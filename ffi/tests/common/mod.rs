//! What the ffi tests share: checking a committed generated file (the C header, the field
//! lists for Go and Python) against what the code generates now.

use std::path::Path;

/// Passes when the committed file at `path` equals `generated`; with the environment
/// variable `update` set, writes `generated` there instead. Otherwise fails naming the
/// first line that differs and the command that regenerates it (`regenerate`).
pub(crate) fn committed_matches(path: &Path, generated: &str, update: &str, regenerate: &str) {
    if std::env::var_os(update).is_some() {
        std::fs::write(path, generated).expect("write the generated file");
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()))
            + 1;
        panic!(
            "{} is out of date (first difference at line {line}); regenerate with \
             {update}=1 {regenerate}",
            path.display()
        );
    }
}
