//! Generates the admin API from docs/admin.proto with protox, a protobuf
//! compiler written in Rust, so building binx needs no `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let docs = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../docs");
    let proto = docs.join("admin.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile([&proto], [&docs])?;
    tonic_prost_build::configure()
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER").is_some())
        .build_client(std::env::var_os("CARGO_FEATURE_CLIENT").is_some())
        .build_transport(false)
        .btree_map(".")
        .compile_fds(descriptors)?;
    Ok(())
}
