# The proplet device agent, as used by Proplets of type k8s (spec.k8s.image).
#   docker build -f configs/docker/proplet.Dockerfile -t proplet:latest .
# For devices, prefer the plain binary (scripts/build-agent-cross.sh) and configs/proplet.service.

FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile release-agent --locked -p proplet-agent --bin proplet \
    && install -D -m 0755 target/release-agent/proplet /out/proplet

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o 65532 -g 65532 -m 0700 /var/lib/proplet
COPY --from=builder /out/proplet /usr/local/bin/proplet
# Result spool and module cache; the operator mounts a volume here for k8s proplets.
ENV PROPLET_STATE_DIR=/var/lib/proplet
USER 65532:65532
# Agent health and metrics (/health, /ready, /metrics) when PROPLET_METRICS_ENABLED=true.
EXPOSE 9092
ENTRYPOINT ["/usr/local/bin/proplet"]
