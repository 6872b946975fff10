//! An object's namespace and name: how the drivers, their caches and their logs name it.

/// An object by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    /// Namespace (`default` when the object had none).
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl ObjectName {
    /// `namespace`/`name`.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    /// The name of `object`.
    pub fn of(object: &impl kube::Resource) -> Self {
        Self::from_meta(object.meta())
    }

    /// The name of the object `meta` describes.
    pub fn from_meta(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self::new(
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or_default(),
        )
    }
}

impl std::fmt::Display for ObjectName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
