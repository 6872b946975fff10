# The propeller operator + embedded MQTT broker.
#   docker build -f configs/docker/propeller.Dockerfile -t propeller:latest .
# (run from the repository root; .dockerignore keeps target/ and .git out of the context)

FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
# Cache mounts keep the registry and build tree between builds; the binary is copied out
# because cache mounts are not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p propeller-operator --bin propeller \
    && install -D -m 0755 target/release/propeller /out/propeller

# The runtime image. This stage uses only FROM, COPY --from=builder, ENV, USER, EXPOSE,
# ENTRYPOINT and CMD: the in-cluster tests build the same image without Docker by reading
# these lines (tests/support/image.rs), so there is one description of it.
# distroless/cc: glibc, libgcc, the CA certificates and the user nonroot (65532), which is
# all the binary loads.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/propeller /usr/local/bin/propeller
# The Deployment also sets runAsNonRoot and a read-only root filesystem.
USER 65532:65532
# 1883 MQTT, 8883 MQTT over TLS (when enabled), 8080 /healthz /readyz /metrics.
EXPOSE 1883 8883 8080
ENTRYPOINT ["/usr/local/bin/propeller"]
CMD ["run"]
