# The proplet device agent, as used by Proplets of type k8s (spec.k8s.image).
#   docker build -f configs/docker/proplet.Dockerfile -t proplet:latest .
# For devices, prefer the Debian package (scripts/build-deb.sh), or the plain binary
# (scripts/build-agent-cross.sh) with configs/proplet.service.

FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile release-agent --locked -p proplet-agent --bin proplet \
    && install -D -m 0755 target/release-agent/proplet /out/proplet \
    && install -d /out/state

# The runtime image: only FROM, COPY --from=builder, ENV, USER, EXPOSE, ENTRYPOINT and CMD,
# so the in-cluster tests build the same image without Docker from these lines
# (tests/support/image.rs).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/proplet /usr/local/bin/proplet
# Result spool and module cache; the operator mounts an emptyDir here for k8s proplets.
COPY --from=builder --chown=65532:65532 /out/state /var/lib/proplet
ENV PROPLET_STATE_DIR=/var/lib/proplet
USER 65532:65532
# Agent health and metrics (/health, /ready, /metrics) when PROPLET_METRICS_ENABLED=true.
EXPOSE 9092
ENTRYPOINT ["/usr/local/bin/proplet"]
