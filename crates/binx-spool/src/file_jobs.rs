//! The file system jobs of a `file://` store, each within a time limit
//! and a bounded number unfinished at once.
//!
//! A network file system that stops answering (a hard NFS or EFS mount
//! whose server went away) blocks a thread in the kernel for as long as it
//! hangs, and no timeout can take that thread back. So a job is given up
//! once the file system made no progress for it for the store's timeout
//! (its caller gets an error, as for an unreachable remote store; a slow
//! but healthy disk that writes a large batch makes progress, and is not
//! failed), but it keeps its place among the store's unfinished jobs
//! until its thread returns: a hung mount holds at most
//! [`FILE_JOBS_UNFINISHED`] jobs, and what they hold, however often
//! producers and consumers ask again; past that, a job fails without being
//! started.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Jobs of one store unfinished at once, those given up on included.
/// Enough for a busy healthy disk (each job is one file system round trip,
/// or a batch of them); far below tokio's 512 blocking threads, which the
/// rest of binxd needs too.
pub const FILE_JOBS_UNFINISHED: usize = 64;

/// What a file system job that did not answer in time fails with. The
/// job's thread may still be stuck in the kernel; what it leaves, if it
/// ever finishes, is a file no marker names, which the pruner deletes at
/// its expiry.
pub(crate) fn file_system_timed_out(limit: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the file system did not answer for {limit:?} (spool_request_timeout; a hung network mount?)"
        ),
    )
}

/// A `file://` store's jobs: see the module's documentation.
#[derive(Clone, Debug)]
pub struct FileJobs {
    limit: Duration,
    unfinished: Arc<Semaphore>,
    places: usize,
    /// Steps any job of the store made (and jobs that ended): a job waiting
    /// for a place fails only if none came for [`FileJobs::limit`].
    store_steps: Arc<AtomicU64>,
    /// Jobs given up on, and jobs refused for want of a place.
    given_up: Arc<AtomicU64>,
}

/// What a job tells its waiter as it goes: each file written, each write
/// call, so that a long job on a slow disk is told from a hung one.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    job: Arc<AtomicU64>,
    store: Arc<AtomicU64>,
}

impl Progress {
    /// The file system answered one more call of the job.
    pub fn step(&self) {
        self.job.fetch_add(1, Ordering::Relaxed);
        self.store.fetch_add(1, Ordering::Relaxed);
    }

    fn steps(&self) -> u64 {
        self.job.load(Ordering::Relaxed)
    }
}

impl FileJobs {
    /// Jobs given up after `limit`, at most `places` unfinished at once.
    pub fn new(limit: Duration, places: usize) -> FileJobs {
        FileJobs {
            limit,
            unfinished: Arc::new(Semaphore::new(places)),
            places,
            store_steps: Arc::default(),
            given_up: Arc::default(),
        }
    }

    /// How long a job may go without progress, or wait for a place while
    /// no job of the store makes any.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// Jobs unfinished now, those given up on included.
    pub fn unfinished(&self) -> usize {
        self.places - self.unfinished.available_permits()
    }

    /// Jobs given up on so far, and jobs refused for want of a place.
    pub fn given_up(&self) -> u64 {
        self.given_up.load(Ordering::Relaxed)
    }

    /// Runs `job` on a task of its own, which holds its place until the job
    /// ends, after its caller gave up on it too. Gives up waiting for a
    /// place once no job of the store made progress for
    /// [`FileJobs::limit`], and on the job once it made none for as long
    /// (it reports its steps to the [`Progress`] it is given; one that
    /// reports none has `limit` in all). An error (kind `TimedOut`) says
    /// which of the two did not come.
    pub async fn run<T, F>(&self, job: impl FnOnce(Progress) -> F) -> std::io::Result<T>
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        let place = self.place().await?;
        let progress = Progress {
            job: Arc::default(),
            store: self.store_steps.clone(),
        };
        let job = job(progress.clone());
        let store_steps = self.store_steps.clone();
        let mut running = tokio::spawn(async move {
            let done = job.await;
            store_steps.fetch_add(1, Ordering::Relaxed);
            drop(place);
            done
        });
        let mut seen = progress.steps();
        loop {
            match tokio::time::timeout(self.limit, &mut running).await {
                Ok(Ok(done)) => return Ok(done),
                Ok(Err(failed)) => {
                    return Err(std::io::Error::other(format!(
                        "file system job failed: {failed}"
                    )));
                }
                Err(_) if progress.steps() == seen => {
                    self.given_up.fetch_add(1, Ordering::Relaxed);
                    return Err(file_system_timed_out(self.limit));
                }
                Err(_) => seen = progress.steps(),
            }
        }
    }

    /// A place among the store's unfinished jobs, waited for while jobs of
    /// the store make progress.
    async fn place(&self) -> std::io::Result<OwnedSemaphorePermit> {
        let mut waiting = std::pin::pin!(self.unfinished.clone().acquire_owned());
        let mut seen = self.store_steps.load(Ordering::Relaxed);
        loop {
            match tokio::time::timeout(self.limit, &mut waiting).await {
                Ok(place) => return place.map_err(std::io::Error::other),
                Err(_) => {
                    let now = self.store_steps.load(Ordering::Relaxed);
                    if now == seen {
                        self.given_up.fetch_add(1, Ordering::Relaxed);
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "{} file system jobs of this store have not finished, none answered for {:?} (spool_request_timeout; a hung network mount?), so no more is started",
                                self.places, self.limit
                            ),
                        ));
                    }
                    seen = now;
                }
            }
        }
    }
}

#[cfg(test)]
impl FileJobs {
    /// Whether every job ended within 10 s (their places all given back).
    pub(crate) async fn all_finished(&self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.unfinished() > 0 {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that blocks a thread until `release` is sent to (or dropped).
    async fn stuck(release: std::sync::mpsc::Receiver<()>) -> bool {
        tokio::task::spawn_blocking(move || release.recv().is_ok())
            .await
            .unwrap_or(false)
    }

    /// Jobs stuck past the limit fail in time and keep their places while
    /// their threads are stuck: once every place is held, a new job fails
    /// after the limit without being started; once the threads return,
    /// jobs run again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stuck_jobs_fail_in_time_and_hold_their_places_until_they_return() {
        let limit = Duration::from_millis(200);
        let jobs = FileJobs::new(limit, 2);
        let mut releases = Vec::new();
        for _ in 0..2 {
            let (release, wait) = std::sync::mpsc::channel();
            releases.push(release);
            let started = std::time::Instant::now();
            let failed = jobs
                .run(|_| stuck(wait))
                .await
                .expect_err("a stuck job fails");
            assert!(started.elapsed() >= limit && started.elapsed() < limit * 10);
            assert_eq!(failed.kind(), std::io::ErrorKind::TimedOut);
            assert!(
                failed.to_string().contains("did not answer for 200ms"),
                "{failed}"
            );
        }
        assert_eq!(jobs.unfinished(), 2, "given up, still stuck");
        assert_eq!(jobs.given_up(), 2);

        let started_at = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = started_at.clone();
        let refused = jobs
            .run(|_| async move { started.store(true, std::sync::atomic::Ordering::SeqCst) })
            .await
            .expect_err("no place");
        assert!(
            refused
                .to_string()
                .contains("2 file system jobs of this store have not finished"),
            "{refused}"
        );
        assert!(
            !started_at.load(std::sync::atomic::Ordering::SeqCst),
            "never started"
        );
        assert_eq!(jobs.given_up(), 3);

        for release in releases {
            release.send(()).expect("the stuck job still waits");
        }
        assert!(jobs.all_finished().await, "the places come back");
        assert_eq!(jobs.run(|_| async { 7 }).await.expect("runs"), 7);
    }

    /// A job longer than the limit that makes progress all along (a large
    /// batch on a slow disk) is waited for; one that stops making progress
    /// fails a limit after its last step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_that_make_progress_are_waited_for_past_the_limit() {
        let limit = Duration::from_millis(500);
        let jobs = FileJobs::new(limit, 4);
        let started = std::time::Instant::now();
        let steps = jobs
            .run(|progress| async move {
                for _ in 0..20 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    progress.step();
                }
                20
            })
            .await
            .expect("a job making progress is waited for");
        assert_eq!(steps, 20);
        assert!(started.elapsed() >= Duration::from_secs(1));

        let (release, wait) = std::sync::mpsc::channel::<()>();
        let started = std::time::Instant::now();
        let failed = jobs
            .run(|progress| async move {
                for _ in 0..5 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    progress.step();
                }
                stuck(wait).await
            })
            .await
            .expect_err("a job that stopped making progress fails");
        assert!(
            failed.to_string().contains("did not answer for 500ms"),
            "{failed}"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(750),
            "{:?}",
            started.elapsed()
        );
        drop(release);
        assert!(jobs.all_finished().await, "the place comes back");
    }
}
