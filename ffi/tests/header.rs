//! include/kvr.h is generated from this crate by cbindgen and committed; this test fails
//! when the committed header differs from what the code generates. Run with
//! `KVR_UPDATE_HEADER=1` to rewrite it.

use std::path::PathBuf;

#[test]
fn committed_header_matches_the_code() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let header = crate_dir.join("../include/kvr.h");
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("ffi/cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    if std::env::var_os("KVR_UPDATE_HEADER").is_some() {
        std::fs::write(&header, &generated).expect("write include/kvr.h");
        return;
    }
    let committed = std::fs::read_to_string(&header).unwrap_or_default();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()))
            + 1;
        panic!(
            "include/kvr.h is out of date (first difference at line {line}); \
             regenerate with KVR_UPDATE_HEADER=1 cargo test -p kvr-ffi --test header"
        );
    }
}
