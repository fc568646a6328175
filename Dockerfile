# One image with every Tessera binary: tessera-extender, tessera-manifests, tessera-cdi-generator,
# tessera-device-plugin, tessera-dra-plugin, tessera-nri-plugin, tessera-mps-supervisor. Build: docker build -t tessera:dev .
FROM rust:1.95-trixie AS build
WORKDIR /src
COPY . .
# The CUDA hook is linked with zig for glibc 2.28 (hook/build-portable.sh fetches it from PyPI).
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*
# Shipped binaries without debug info (symbols kept); their debug files in /out/debug.
RUN bash scripts/ship.sh /out

# The debug files for crash reports: docker build --target debug -o type=local,dest=debug .
FROM scratch AS debug
COPY --from=build /out/debug/ /

FROM debian:trixie-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/bin/tessera-* /usr/local/bin/
# Installed on the host by tessera-cdi-generator in hook mode, preloaded into share containers.
COPY --from=build /out/bin/libtessera-cuda-hook.so /usr/local/lib/tessera/
# The extender runs as this user; the node agents run as root (see deploy/tessera.yaml).
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tessera-extender"]
