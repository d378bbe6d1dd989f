//! Gives libkvr.so its SONAME, `libkvr.so.<KVR_ABI_VERSION>`: the ABI generation (bumped on
//! every incompatible change of the C ABI, see kvr.h) is what a shared-library major
//! version means, so a host linked against one generation never loads another. The value
//! is read from kvr-ffi's `KVR_ABI_VERSION` (ffi/src/status.rs), the constant the header's
//! `#define` is generated from; a build script cannot see a dependency's constants.

use std::path::Path;

fn main() {
    let status = Path::new(env!("CARGO_MANIFEST_DIR")).join("../src/status.rs");
    println!("cargo:rerun-if-changed={}", status.display());
    let text = std::fs::read_to_string(&status)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", status.display()));
    let abi: u32 = text
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("pub const KVR_ABI_VERSION: u32 =")?
                .trim()
                .strip_suffix(';')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| {
            panic!(
                "no `pub const KVR_ABI_VERSION: u32 = N;` in {}",
                status.display()
            )
        });
    // ELF targets only (Linux, the BSDs); Mach-O's install name and Windows' DLLs differ.
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if matches!(
        os.as_str(),
        "linux" | "android" | "freebsd" | "netbsd" | "openbsd" | "dragonfly"
    ) {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvr.so.{abi}");
    }
}
