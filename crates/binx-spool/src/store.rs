//! One spool location: an `object_store` store plus the key prefix binx
//! writes under, built from a URL (`file://`, `s3://`, `gs://`, `az://`,
//! `memory://`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::signer::{Method, Signer};
use object_store::{
    ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};
use thiserror::Error;

use crate::file_jobs::{FILE_JOBS_UNFINISHED, FileJobs};

/// Settings for remote stores; the usual environment variables
/// (`AWS_*`, `GOOGLE_*`, `AZURE_*`) fill in what is not set here.
#[derive(Clone, Debug, Default)]
pub struct StoreOptions {
    /// S3-compatible endpoint, e.g. `http://127.0.0.1:9000`.
    pub s3_endpoint: Option<String>,
    /// S3 region, e.g. `us-east-1`.
    pub s3_region: Option<String>,
    /// S3 access key id.
    pub s3_access_key_id: Option<String>,
    /// S3 secret access key.
    pub s3_secret_access_key: Option<String>,
    /// Allow plain `http://` endpoints (test and in-cluster servers).
    pub allow_http: bool,
    /// How long one store request may take, retries included; for a
    /// `file://` store, how long a file system job (a write, a read, a
    /// delete, a listing step) may go without an answer
    /// ([`FileJobs`]): a hung network mount fails it, as an unreachable
    /// remote store does, rather than holding a commit for ever.
    pub request_timeout: Duration,
}

/// Which kind of store a location is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// A local directory (`file://`).
    File,
    /// In this process's memory (`memory://`), for tests.
    Memory,
    /// Amazon S3 or an S3-compatible server (`s3://`, `s3a://`).
    S3,
    /// Google Cloud Storage (`gs://`).
    Gcs,
    /// Azure Blob Storage (`az://`, `abfs://`, `azure://`).
    Azure,
}

impl StoreKind {
    /// Remote stores get encryption by default and can presign URLs.
    pub fn is_remote(self) -> bool {
        matches!(self, StoreKind::S3 | StoreKind::Gcs | StoreKind::Azure)
    }
}

/// A store operation that failed; names the object or the location.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The store URL or an object path is not usable.
    #[error("spool store {url}: {detail}")]
    Config {
        /// The store's URL.
        url: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The store failed a request (unreachable, refused, timed out);
    /// asking again later may work.
    #[error("spool object {object} in {url}: {source}")]
    Io {
        /// The store's URL.
        url: String,
        /// The object's name within the store.
        object: String,
        /// The error object_store reported.
        #[source]
        source: object_store::Error,
    },
    /// The object is not in the store.
    #[error("spool object {object} in {url} does not exist (deleted or expired)")]
    NotFound {
        /// The store's URL.
        url: String,
        /// The object's name within the store.
        object: String,
    },
    /// The store reports a size other than the one expected; the body was
    /// not read.
    #[error(
        "spool object {object} in {url} is {size} bytes, not the {expected} expected; not read"
    )]
    WrongSize {
        /// The store's URL.
        url: String,
        /// The object's name within the store.
        object: String,
        /// The size the store reports, in bytes.
        size: u64,
        /// The size expected, as text (`"N bytes"` or `"at most N bytes"`).
        expected: String,
    },
}

/// What an object read back must measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectSize {
    /// Exactly this many bytes.
    Exactly(u64),
    /// At most this many bytes.
    AtMost(u64),
}

/// One base location objects are written under.
#[derive(Clone, Debug)]
pub struct SpoolStore {
    url: String,
    kind: StoreKind,
    store: Arc<dyn ObjectStore>,
    signer: Option<Arc<dyn Signer>>,
    prefix: Path,
    /// `file://` stores: the directory, for writes that bypass object_store
    /// (see [`SpoolStore::local_path`]).
    dir: Option<std::path::PathBuf>,
    /// `file://` stores: their file system jobs, each within
    /// [`StoreOptions::request_timeout`]; remote stores time out inside
    /// object_store, `memory://` never waits.
    file_jobs: Option<FileJobs>,
}

impl SpoolStore {
    /// Builds the store a URL names. `file://` directories are created.
    pub fn from_url(url: &str, options: &StoreOptions) -> Result<SpoolStore, StoreError> {
        let config = |detail: String| StoreError::Config {
            url: url.to_string(),
            detail,
        };
        let parsed = url::Url::parse(url).map_err(|e| config(format!("not a URL: {e}")))?;
        let timeout = if options.request_timeout.is_zero() {
            Duration::from_secs(10)
        } else {
            options.request_timeout
        };
        let client = ClientOptions::new()
            .with_timeout(timeout)
            .with_connect_timeout(timeout.min(Duration::from_secs(5)))
            .with_allow_http(options.allow_http);
        let retry = RetryConfig {
            max_retries: 2,
            retry_timeout: timeout,
            ..RetryConfig::default()
        };
        let bucket_url = format!("{}://{}", parsed.scheme(), parsed.host_str().unwrap_or(""));
        let prefix = Path::parse(parsed.path().trim_matches('/'))
            .map_err(|e| config(format!("bad key prefix: {e}")))?;
        let fail = |e: object_store::Error| config(e.to_string());
        let mut local_dir = None;
        let (kind, store, signer, prefix): (_, Arc<dyn ObjectStore>, Option<Arc<dyn Signer>>, _) =
            match parsed.scheme() {
                "file" => {
                    let dir = parsed
                        .to_file_path()
                        .map_err(|()| config("a file:// URL needs an absolute path".into()))?;
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| config(format!("cannot create {}: {e}", dir.display())))?;
                    // A task's markers and manifest live in a directory of
                    // their own (`commit/<task>/`); without the cleanup its
                    // deletion left the directory behind, one per task for
                    // ever (655 after one TPC-H run).
                    let fs = LocalFileSystem::new_with_prefix(&dir)
                        .map_err(fail)?
                        .with_automatic_cleanup(true);
                    local_dir = Some(dir);
                    (StoreKind::File, Arc::new(fs), None, Path::default())
                }
                "memory" => (StoreKind::Memory, Arc::new(InMemory::new()), None, prefix),
                "s3" | "s3a" => {
                    let mut b = AmazonS3Builder::from_env()
                        .with_url(bucket_url)
                        .with_client_options(client)
                        .with_retry(retry)
                        .with_allow_http(options.allow_http);
                    if let Some(endpoint) = &options.s3_endpoint {
                        // S3-compatible servers are addressed path-style.
                        b = b
                            .with_endpoint(endpoint)
                            .with_virtual_hosted_style_request(false);
                    }
                    if let Some(region) = &options.s3_region {
                        b = b.with_region(region);
                    }
                    if let Some(id) = &options.s3_access_key_id {
                        b = b.with_access_key_id(id);
                    }
                    if let Some(secret) = &options.s3_secret_access_key {
                        b = b.with_secret_access_key(secret);
                    }
                    let s3 = Arc::new(b.build().map_err(fail)?);
                    (StoreKind::S3, s3.clone(), Some(s3), prefix)
                }
                "gs" => {
                    let gcs = Arc::new(
                        GoogleCloudStorageBuilder::from_env()
                            .with_url(bucket_url)
                            .with_client_options(client)
                            .with_retry(retry)
                            .build()
                            .map_err(fail)?,
                    );
                    (StoreKind::Gcs, gcs.clone(), Some(gcs), prefix)
                }
                "az" | "abfs" | "azure" => {
                    let az = Arc::new(
                        MicrosoftAzureBuilder::from_env()
                            .with_url(bucket_url)
                            .with_client_options(client)
                            .with_retry(retry)
                            .build()
                            .map_err(fail)?,
                    );
                    (StoreKind::Azure, az.clone(), Some(az), prefix)
                }
                other => {
                    return Err(config(format!(
                        "unknown scheme {other:?}; use file://, s3://, gs://, az:// or memory://"
                    )));
                }
            };
        Ok(SpoolStore {
            url: url.trim_end_matches('/').to_string(),
            kind,
            store,
            signer,
            prefix,
            file_jobs: (kind == StoreKind::File)
                .then(|| FileJobs::new(timeout, FILE_JOBS_UNFINISHED)),
            dir: local_dir,
        })
    }

    /// For a `file://` store, the file object `name` (no `/` in it) is, so
    /// a segment can be written with one `writev` while its checksum is
    /// computed beside it; object_store writes each piece with its own call.
    pub fn local_path(&self, name: &str) -> Option<std::path::PathBuf> {
        (!name.contains('/')).then(|| self.dir.as_ref().map(|d| d.join(name)))?
    }

    /// For a `file://` store, its file system jobs.
    pub fn file_jobs(&self) -> Option<&FileJobs> {
        self.file_jobs.as_ref()
    }

    /// Runs `op` on (a copy of) this store and object `name`, for a
    /// `file://` store as one of its [`FileJobs`].
    async fn bounded<T, F>(
        &self,
        name: &str,
        op: impl FnOnce(SpoolStore, String) -> F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let job = op(self.clone(), name.to_string());
        let Some(jobs) = &self.file_jobs else {
            return job.await;
        };
        jobs.run(|_| job)
            .await
            .unwrap_or_else(|e| Err(self.io(name, local_failure(e))))
    }

    /// For a `file://` store, the directory it keeps its objects in.
    pub fn local_dir(&self) -> Option<&std::path::Path> {
        self.dir.as_deref()
    }

    /// The store's URL, without a trailing `/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Which kind of store this is.
    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    /// Where object `name` (a path relative to the prefix, `/` between
    /// parts) lives in the store.
    fn path(&self, name: &str) -> Result<Path, StoreError> {
        let full = if self.prefix.as_ref().is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", self.prefix.as_ref())
        };
        Path::parse(&full).map_err(|e| StoreError::Config {
            url: self.url.clone(),
            detail: format!("bad object path {name:?}: {e}"),
        })
    }

    fn io(&self, name: &str, source: object_store::Error) -> StoreError {
        match source {
            object_store::Error::NotFound { .. } => StoreError::NotFound {
                url: self.url.clone(),
                object: name.to_string(),
            },
            source => StoreError::Io {
                url: self.url.clone(),
                object: name.to_string(),
                source,
            },
        }
    }

    /// Writes object `name` (relative to the prefix), replacing any there.
    pub async fn put(&self, name: &str, data: Bytes) -> Result<(), StoreError> {
        self.put_parts(name, vec![data]).await
    }

    /// Writes an object made of `parts`, in order (not joined first).
    pub async fn put_parts(&self, name: &str, parts: Vec<Bytes>) -> Result<(), StoreError> {
        let path = self.path(name)?;
        self.bounded(name, |store, name| async move {
            store
                .store
                .put(&path, parts.into_iter().collect::<PutPayload>())
                .await
                .map(|_| ())
                .map_err(|e| store.io(&name, e))
        })
        .await
    }

    /// Reads the whole of object `name` (relative to the prefix), whatever
    /// its size.
    pub async fn get(&self, name: &str) -> Result<Bytes, StoreError> {
        self.get_checked(name, ObjectSize::AtMost(u64::MAX)).await
    }

    /// Reads an object whose size the store reports first: one of another
    /// size is refused before its body is read, so a swapped or grown
    /// object never costs more memory than the one expected.
    pub async fn get_checked(&self, name: &str, expected: ObjectSize) -> Result<Bytes, StoreError> {
        self.bounded(name, move |store, name| async move {
            store.get_checked_unbounded(&name, expected).await
        })
        .await
    }

    async fn get_checked_unbounded(
        &self,
        name: &str,
        expected: ObjectSize,
    ) -> Result<Bytes, StoreError> {
        let result = self
            .store
            .get(&self.path(name)?)
            .await
            .map_err(|e| self.io(name, e))?;
        let size = result.meta.size;
        let fits = match expected {
            ObjectSize::Exactly(n) => size == n,
            ObjectSize::AtMost(n) => size <= n,
        };
        if !fits {
            return Err(StoreError::WrongSize {
                url: self.url.clone(),
                object: name.to_string(),
                size,
                expected: match expected {
                    ObjectSize::Exactly(n) => format!("{n} bytes"),
                    ObjectSize::AtMost(n) => format!("at most {n} bytes"),
                },
            });
        }
        result.bytes().await.map_err(|e| self.io(name, e))
    }

    /// Reads the `len` bytes of object `name` from `offset` (a segment
    /// packed with others): an object that ends before them is refused
    /// before its bytes are read, so a forged offset or length read from a
    /// marker costs no more than the object holds.
    pub async fn get_range_checked(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, StoreError> {
        self.bounded(name, move |store, name| async move {
            store.get_range_unbounded(&name, offset, len).await
        })
        .await
    }

    async fn get_range_unbounded(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, StoreError> {
        let wrong = |size: u64| StoreError::WrongSize {
            url: self.url.clone(),
            object: name.to_string(),
            size,
            expected: format!("bytes {offset} to {} in it", offset.saturating_add(len)),
        };
        let end = offset
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or_else(|| wrong(0))?;
        let options = GetOptions {
            range: Some(GetRange::Bounded(offset..end)),
            ..GetOptions::default()
        };
        let path = self.path(name)?;
        let result = match self.store.get_opts(&path, options).await {
            Ok(result) => result,
            Err(e) => {
                // A range past the object's end is a wrong size for good,
                // not a store failure to ask again about.
                return Err(match self.store.head(&path).await {
                    Ok(meta) if meta.size < end => wrong(meta.size),
                    _ => self.io(name, e),
                });
            }
        };
        if result.meta.size < end || result.range != (offset..end) {
            return Err(wrong(result.meta.size));
        }
        let size = result.meta.size;
        let bytes = result.bytes().await.map_err(|e| self.io(name, e))?;
        if bytes.len() as u64 != len {
            return Err(wrong(size));
        }
        Ok(bytes)
    }

    /// Deletes an object; one already gone counts as deleted.
    pub async fn delete(&self, name: &str) -> Result<(), StoreError> {
        let path = self.path(name)?;
        self.bounded(name, |store, name| async move {
            match store.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(store.io(&name, e)),
            }
        })
        .await
    }

    /// Every object under the prefix (at any depth), as its path relative
    /// to the prefix and when it was written; in no particular order.
    pub async fn list(&self) -> Result<Vec<(String, std::time::SystemTime)>, StoreError> {
        self.list_under("").await
    }

    /// Like [`SpoolStore::list`], only the objects under folder `dir`
    /// (relative to the prefix, `/` between parts; "" for all).
    pub async fn list_under(
        &self,
        dir: &str,
    ) -> Result<Vec<(String, std::time::SystemTime)>, StoreError> {
        let mut listing = std::pin::pin!(self.listing(dir)?);
        let mut names = Vec::new();
        while let Some(entry) = listing.next().await {
            names.push(entry?);
        }
        Ok(names)
    }

    /// The objects under folder `dir` one at a time, as the store lists
    /// them (a page of names held at once, not the whole listing: a store
    /// of millions of objects costs the pruner no memory for them).
    pub fn listing(
        &self,
        dir: &str,
    ) -> Result<
        impl futures_util::Stream<Item = Result<(String, std::time::SystemTime), StoreError>> + '_,
        StoreError,
    > {
        let dir = dir.trim_end_matches('/');
        let folder = if dir.is_empty() {
            (!self.prefix.as_ref().is_empty()).then(|| self.prefix.clone())
        } else {
            Some(self.path(dir)?)
        };
        let skip = if self.prefix.as_ref().is_empty() {
            0
        } else {
            self.prefix.as_ref().len() + 1
        };
        // Each step of a `file://` store's listing is one of its jobs (the
        // listing goes with it: a step given up on finishes on its own); a
        // step that fails ends the listing with its error.
        let steps = futures_util::stream::unfold(
            Some(self.store.list(folder.as_ref())),
            move |listing| async move {
                let mut listing = listing?;
                let Some(jobs) = &self.file_jobs else {
                    return listing.next().await.map(|meta| (meta, Some(listing)));
                };
                match jobs
                    .run(|_| async move { (listing.next().await, listing) })
                    .await
                {
                    Ok((meta, listing)) => meta.map(|meta| (meta, Some(listing))),
                    Err(e) => Some((Err(local_failure(e)), None)),
                }
            },
        );
        Ok(steps.filter_map(move |meta| {
            let entry = match meta {
                Ok(meta) => meta
                    .location
                    .as_ref()
                    .get(skip..)
                    .map(|name| Ok((name.to_string(), meta.last_modified.into()))),
                Err(e) => Some(Err(self.io("(listing)", e))),
            };
            std::future::ready(entry)
        }))
    }

    /// A URL anyone holding it may GET for `valid_for`, when the store can
    /// sign one (S3, GCS, Azure); `None` for file and memory stores.
    pub async fn presign(
        &self,
        name: &str,
        valid_for: Duration,
    ) -> Result<Option<String>, StoreError> {
        let Some(signer) = &self.signer else {
            return Ok(None);
        };
        let url = signer
            .signed_url(Method::GET, &self.path(name)?, valid_for)
            .await
            .map_err(|e| self.io(name, e))?;
        Ok(Some(url.to_string()))
    }
}

/// A [`FileJobs`] failure as object_store reports a local one.
fn local_failure(e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "LocalFileSystem",
        source: Box::new(e),
    }
}
