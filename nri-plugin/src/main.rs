use clap::Parser;

/// tessera-nri-plugin
#[derive(Parser)]
#[command(version, about)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
}
