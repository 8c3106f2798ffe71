# Warden's server image, in two stages: the first builds `warden` from this checkout on the
# toolchain rust-toolchain.toml pins; the second holds that binary and nothing else of the build,
# on a distroless base (glibc, CA certificates, no shell), and runs it as a non-root user. The
# configuration, policies, model and certificates come from volumes (deploy/kubernetes/).
#
#   docker build -t warden .
#   docker run --rm -p 8443:8443 -v "$PWD/models:/models:ro" warden serve --listen 0.0.0.0:8443 \
#       --model /models/SmolLM2-135M-Instruct.Q4_1.gguf --data-dir /tmp/warden

FROM rust:1.97-bookworm AS build
WORKDIR /src
COPY . .
# rust-toolchain.toml names the toolchain; install it explicitly (as .ci/run does).
RUN rustup toolchain install \
    && cargo build --release --locked --bin warden \
    && install -m 0755 target/release/warden /warden

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /warden /usr/local/bin/warden
# 65532: distroless's nonroot user.
USER 65532:65532
EXPOSE 8443 9100 9101
ENTRYPOINT ["/usr/local/bin/warden"]
CMD ["serve", "--config", "/etc/warden/config/router.toml", "--role", "router"]
