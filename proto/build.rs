//! Generates the protocol code from the `.proto` files in this crate (protoc comes from the
//! `protoc-bin-vendored` crate, so no system package is needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    if std::env::var_os("CARGO_FEATURE_CRI").is_some() {
        tonic_prost_build::configure()
            .build_server(false)
            .compile_protos(&["cri/api.proto"], &["cri"])?;
    }
    if std::env::var_os("CARGO_FEATURE_DEVICEPLUGIN").is_some() {
        tonic_prost_build::configure().compile_protos(&["deviceplugin/api.proto"], &["deviceplugin"])?;
    }
    println!("cargo:rerun-if-changed=cri/api.proto");
    println!("cargo:rerun-if-changed=deviceplugin/api.proto");
    Ok(())
}
