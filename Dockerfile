# Warden's server image, in two stages: the first builds `warden` from this checkout on the
# toolchain rust-toolchain.toml pins; the second holds that binary and nothing else of the build,
# on a distroless base (glibc, CA certificates, no shell), and runs it as a non-root user. The
# configuration, policies, model and certificates come from volumes, and the state goes on one
# (docs/deploying.md).
#
#   docker build -t warden .
#   docker run --rm warden                  # no arguments: the usage (warden --help)
#   docker run -d --name warden -p 8443:8443 -v warden-data:/var/lib/warden \
#       -v "$PWD/models:/models:ro" -v "$PWD/policies:/etc/warden/policies:ro" \
#       -e WARDEN_POLICIES=/etc/warden/policies warden serve --listen 0.0.0.0:8443 \
#       --data-dir /var/lib/warden --model /models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# (The volume must be writable by user 65532 first; docs/deploying.md shows how.)

FROM rust:1.97-bookworm AS build
WORKDIR /src
COPY . .
# The image's binary carries no symbols or debug information: the release profile keeps line
# tables for backtraces elsewhere, but they would only add to every pull of the image.
ENV CARGO_PROFILE_RELEASE_STRIP=symbols
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
# A bare `docker run` prints the usage and exits. Arguments given to `docker run` (`serve ...`),
# or a Kubernetes container's `args` (deploy/kubernetes), replace these.
CMD ["--help"]
