# One image with every Tessera binary: tessera-extender, tessera-cdi-generator,
# tessera-device-plugin, tessera-nri-plugin, tessera-mps-supervisor. Build: docker build -t tessera:dev .
FROM rust:1.95-trixie AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
        -p tessera-extender -p tessera-cdi-generator -p tessera-device-plugin -p tessera-nri-plugin -p tessera-mps \
        -p tessera-cuda-hook \
    && mkdir /out \
    && cp target/release/tessera-extender target/release/tessera-cdi-generator \
          target/release/tessera-device-plugin target/release/tessera-nri-plugin \
          target/release/tessera-mps-supervisor /out/ \
    && cp target/release/libtessera_cuda_hook.so /out/libtessera-cuda-hook.so

FROM debian:trixie-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/tessera-* /usr/local/bin/
# Installed on the host by tessera-cdi-generator in hook mode, preloaded into share containers.
COPY --from=build /out/libtessera-cuda-hook.so /usr/local/lib/tessera/
# The extender runs as this user; the node agents run as root (see deploy/tessera.yaml).
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tessera-extender"]
