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
    if std::env::var_os("CARGO_FEATURE_DRA").is_some() {
        tonic_prost_build::configure().compile_protos(&["pluginregistration/api.proto"], &["pluginregistration"])?;
        tonic_prost_build::configure().compile_protos(&["dra/api.proto"], &["dra"])?;
        tonic_prost_build::configure().compile_protos(&["drahealth/api.proto"], &["drahealth"])?;
    }
    if std::env::var_os("CARGO_FEATURE_NRI").is_some() {
        nri()?;
    }
    println!("cargo:rerun-if-changed=cri/api.proto");
    println!("cargo:rerun-if-changed=nri/api.proto");
    println!("cargo:rerun-if-changed=deviceplugin/api.proto");
    println!("cargo:rerun-if-changed=pluginregistration/api.proto");
    println!("cargo:rerun-if-changed=dra/api.proto");
    println!("cargo:rerun-if-changed=drahealth/api.proto");
    Ok(())
}

/// ttrpc (async) and rust-protobuf code for NRI. The generated files carry inner attributes,
/// which `include!` cannot take, so they are stripped.
fn nri() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("nri");
    std::fs::create_dir_all(&out)?;
    ttrpc_codegen::Codegen::new()
        .out_dir(&out)
        .inputs(["nri/api.proto"])
        .include("nri")
        .rust_protobuf()
        .customize(ttrpc_codegen::Customize {
            async_all: true,
            ..Default::default()
        })
        .rust_protobuf_customize(ttrpc_codegen::ProtobufCustomize::default().gen_mod_rs(false))
        .run()?;
    for entry in std::fs::read_dir(&out)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        let kept: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("#![") && !l.trim_start().starts_with("//!"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, kept)?;
    }
    Ok(())
}
