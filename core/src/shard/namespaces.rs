//! Sharding by namespace in the API server's own terms, so that each replica's watches can
//! ask the API server for its namespaces only (sharded list and watch, KEP-5866: Kubernetes
//! 1.36 and later, behind the `ShardedListAndWatch` feature gate).
//!
//! The API server hashes `metadata.namespace` with 64-bit FNV-1a and keeps the objects whose
//! hash falls in the ranges a `shardSelector` names. Here the hash space is cut into
//! [`BUCKETS`] equal ranges; each bucket is a key owned by rendezvous over the members like
//! any other ([`View::owner`]), so a membership change moves only the joining or departing
//! member's buckets, and a member's share is the union of its buckets' ranges, which one
//! selector expresses.

use super::View;

/// How many equal ranges the namespace hash space is cut into: enough for an even spread
/// over a handful of replicas, few enough for a short selector (at most one range each).
pub const BUCKETS: u32 = 64;

/// Bits of the hash that pick the bucket (`BUCKETS` = 2^6).
const BUCKET_BITS: u32 = BUCKETS.trailing_zeros();

/// The API server's hash of a namespace: 64-bit FNV-1a of its name's bytes.
pub fn namespace_hash(namespace: &str) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    namespace.bytes().fold(OFFSET_BASIS, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

/// The bucket `namespace` falls in.
pub fn bucket_of(namespace: &str) -> u32 {
    // The shift leaves BUCKET_BITS bits: always below BUCKETS.
    (namespace_hash(namespace) >> (64 - BUCKET_BITS)) as u32
}

/// The ownership key of bucket `bucket`.
pub fn bucket_key(bucket: u32) -> String {
    format!("namespaces/{bucket:02}")
}

/// A range of namespace hashes, `start` included, `end` excluded (`end` may be 2^64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashRange {
    /// The first hash in the range.
    pub start: u64,
    /// One past the last hash in the range.
    pub end: u128,
}

/// The hash ranges of the buckets `member` owns in `view`, adjacent ones merged, in order.
pub fn owned_ranges(view: &View, member: &str) -> Vec<HashRange> {
    let width = 1u128 << (64 - BUCKET_BITS);
    let mut ranges: Vec<HashRange> = Vec::new();
    for bucket in 0..BUCKETS {
        if view.owner(&bucket_key(bucket)) != Some(member) {
            continue;
        }
        let start = u128::from(bucket) * width;
        let end = start + width;
        match ranges.last_mut() {
            Some(last) if last.end == start => last.end = end,
            // `start` is below 2^64: the buckets cut the u64 range.
            _ => ranges.push(HashRange {
                start: u64::try_from(start).unwrap_or(u64::MAX),
                end,
            }),
        }
    }
    ranges
}

/// Whether `namespace` is in `ranges`.
pub fn covers(ranges: &[HashRange], namespace: &str) -> bool {
    let hash = namespace_hash(namespace);
    ranges
        .iter()
        .any(|r| hash >= r.start && u128::from(hash) < r.end)
}

/// The `shardSelector` asking the API server for the objects of the namespaces in `ranges`.
/// With no range it names only the last hash value: the API server has no empty selector, and
/// a namespace whose hash is exactly 2^64 - 1 is a one-in-2^64 chance.
pub fn selector(ranges: &[HashRange]) -> String {
    let term = |start: u64, end: u128| {
        format!("shardRange(object.metadata.namespace, '0x{start:016x}', '0x{end:016x}')")
    };
    if ranges.is_empty() {
        return term(u64::MAX, 1u128 << 64);
    }
    ranges
        .iter()
        .map(|r| term(r.start, r.end))
        .collect::<Vec<_>>()
        .join(" || ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_the_api_servers() {
        // Computed by a kube-apiserver 1.36.2: a selector on exactly this value listed the
        // objects of `default`.
        assert_eq!(namespace_hash("default"), 0xebad_a516_8620_c5fe);
        // FNV-1a's published vectors.
        assert_eq!(namespace_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(namespace_hash("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn the_members_ranges_cover_the_hash_space_once() {
        let view = View::new(["r0", "r1", "r2"]);
        let mut all: Vec<HashRange> = ["r0", "r1", "r2"]
            .iter()
            .flat_map(|m| owned_ranges(&view, m))
            .collect();
        all.sort_by_key(|r| r.start);
        assert_eq!(all.first().map(|r| r.start), Some(0));
        assert_eq!(all.last().map(|r| r.end), Some(1u128 << 64));
        for pair in all.windows(2) {
            assert_eq!(u128::from(pair[1].start), pair[0].end, "{all:?}");
        }
        for namespace in ["default", "shard-a", "shard-b", "kube-system", "x"] {
            let owner = view.owner(&bucket_key(bucket_of(namespace)));
            for member in ["r0", "r1", "r2"] {
                assert_eq!(
                    covers(&owned_ranges(&view, member), namespace),
                    owner == Some(member),
                    "{namespace} for {member}"
                );
            }
        }
    }

    #[test]
    fn a_joining_member_takes_only_buckets_and_the_others_keep_the_rest() {
        let before = View::new(["r0", "r1"]);
        let after = View::new(["r0", "r1", "r2"]);
        for bucket in 0..BUCKETS {
            let key = bucket_key(bucket);
            let now = after.owner(&key);
            assert!(
                now == before.owner(&key) || now == Some("r2"),
                "bucket {bucket}"
            );
        }
        assert!(!owned_ranges(&after, "r2").is_empty());
    }

    #[test]
    fn the_selector_names_each_range_and_nothing_when_there_is_none() {
        let ranges = [
            HashRange {
                start: 0,
                end: 1 << 58,
            },
            HashRange {
                start: 0xfc00_0000_0000_0000,
                end: 1u128 << 64,
            },
        ];
        assert_eq!(
            selector(&ranges),
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x0400000000000000') \
             || shardRange(object.metadata.namespace, '0xfc00000000000000', '0x10000000000000000')"
        );
        assert_eq!(
            selector(&[]),
            "shardRange(object.metadata.namespace, '0xffffffffffffffff', '0x10000000000000000')"
        );
        assert!(!covers(&[], "default"));
    }

    #[test]
    fn namespace_sharding_keys_every_kind_of_a_namespace_alike() {
        let by = super::super::ShardBy::Namespace;
        assert_eq!(by.key("Task", "ns", "a"), by.key("Proplet", "ns", "b"));
        assert_eq!(by.key("Task", "ns", "a"), bucket_key(bucket_of("ns")));
    }
}
