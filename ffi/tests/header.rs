//! include/kvr.h is generated from this crate by cbindgen and committed; this test fails
//! when the committed header differs from what the code generates. Run with
//! `KVR_UPDATE_HEADER=1` to rewrite it.

mod common;

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
    common::committed_matches(
        &header,
        &generated,
        "KVR_UPDATE_HEADER",
        "cargo test -p kvr-ffi --test header",
    );
}
