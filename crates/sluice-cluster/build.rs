//! Compiles `proto/sluice.proto` (the driver and worker services) with the vendored `protoc`, so a
//! build needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=proto/sluice.proto");
    tonic_prost_build::configure().compile_with_config(
        config,
        &["proto/sluice.proto"],
        &["proto"],
    )?;
    Ok(())
}
