use clap::Parser;

/// tessera-cdi-generator
#[derive(Parser)]
#[command(version, about)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
}
