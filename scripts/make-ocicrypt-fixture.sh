#!/usr/bin/env bash
# Remakes tests/fixtures/ocicrypt-add/: the add module as a one-layer OCI image, its layer
# encrypted by Confidential Containers' own tools, the way a user of theirs encrypts one:
# `skopeo copy --encryption-key provider:attestation-agent:…` with `coco_keyprovider`
# (guest-components) wrapping the layer key under a key-encryption key named
# kbs:///default/key/ocicrypt-add. tests/encrypted_tasks.rs pushes the result to a real
# registry, puts kek.b64 in a real KBS at default/key/ocicrypt-add and runs it on an agent.
#
#   SKOPEO=/path/to/skopeo COCO_KEYPROVIDER=/path/to/coco_keyprovider scripts/make-ocicrypt-fixture.sh
#
# Needs a skopeo built against ocicrypt >= 1.1 (key-provider support: upstream skopeo 1.13
# builds with Debian's Go 1.19; Debian 12's own skopeo 1.9.3 links ocicrypt 1.0.3 and says
# "Invalid encryption key"), and coco_keyprovider built from guest-components
# (attestation-agent/coco_keyprovider). The key-encryption key is a test key, made anew on
# every run and kept beside the image: never use it for anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
SKOPEO=${SKOPEO:-skopeo}
COCO_KEYPROVIDER=${COCO_KEYPROVIDER:-coco_keyprovider}
OUT=tests/fixtures/ocicrypt-add
KEY_ID=kbs:///default/key/ocicrypt-add
WORK=$(mktemp -d)
PROVIDER_PID=""
cleanup() {
  [ -z "$PROVIDER_PID" ] || kill "$PROVIDER_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The plain image: one gzip tar layer holding add.wasm (add(i32, i32) -> i32).
python3 - "$WORK/plain" <<'EOF'
import base64, gzip, hashlib, io, json, os, sys, tarfile
out = sys.argv[1]
blobs = os.path.join(out, "blobs", "sha256")
os.makedirs(blobs)
module = base64.b64decode("AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags=")
tar = io.BytesIO()
with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as t:
    info = tarfile.TarInfo("add.wasm")
    info.size, info.mode, info.mtime = len(module), 0o644, 0
    t.addfile(info, io.BytesIO(module))
layer = gzip.compress(tar.getvalue(), mtime=0)
def put(data):
    digest = hashlib.sha256(data).hexdigest()
    open(os.path.join(blobs, digest), "wb").write(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}
config = json.dumps({"architecture": "wasm", "os": "wasip1",
                     "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(tar.getvalue()).hexdigest()}"]}}).encode()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(config)},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(layer)}]}).encode()
entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest),
         "annotations": {"org.opencontainers.image.ref.name": "add"}}
json.dump({"schemaVersion": 2, "manifests": [entry]}, open(os.path.join(out, "index.json"), "w"))
json.dump({"imageLayoutVersion": "1.0.0"}, open(os.path.join(out, "oci-layout"), "w"))
EOF

head -c 32 /dev/urandom > "$WORK/kek"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
timeout 300 "$COCO_KEYPROVIDER" --socket "127.0.0.1:$PORT" > "$WORK/keyprovider.log" 2>&1 &
PROVIDER_PID=$!
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done
printf '{"key-providers": {"attestation-agent": {"grpc": "127.0.0.1:%s"}}}\n' "$PORT" > "$WORK/ocicrypt.conf"
OCICRYPT_KEYPROVIDER_CONFIG="$WORK/ocicrypt.conf" "$SKOPEO" copy --insecure-policy \
  --encryption-key "provider:attestation-agent:keypath=$WORK/kek::keyid=$KEY_ID::algorithm=A256GCM" \
  "oci:$WORK/plain:add" "oci:$WORK/encrypted:add"

rm -rf "$OUT"
mkdir -p "$OUT"
cp -r "$WORK/encrypted/." "$OUT/"
base64 -w0 < "$WORK/kek" > "$OUT/kek.b64"
echo >> "$OUT/kek.b64"
grep -q '+encrypted' "$OUT"/blobs/sha256/* || { echo "skopeo left the layer unencrypted" >&2; exit 1; }
echo "wrote $OUT ($("$SKOPEO" --version), key id $KEY_ID)"
