//! SIGPIPE kept from the engine's process.
//!
//! A write to a socket whose sidecar closed it raises SIGPIPE on the
//! writing thread, and its default action ends the process: a Rust program
//! ignores it from its start, but a C or C++ engine that links libbinx has
//! its own disposition, which a library must not change. So the library's
//! own threads block it for good, and each call blocks it on the caller's
//! thread while it runs, then takes back a SIGPIPE the call raised there
//! and restores the caller's mask (what libpq does): the write sees EPIPE,
//! and the call returns the error. Unlike libpq, which takes it back only
//! when its own write saw EPIPE (the writes here are tokio's), a SIGPIPE
//! that came pending during the call for any reason is taken: a thread
//! that sends SIGPIPE on purpose while binx writes is not worth a process
//! that dies of binx's.

use std::mem::MaybeUninit;
use std::ptr;

/// The set holding SIGPIPE alone.
fn sigpipe_set() -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: `set` is writable memory for a sigset_t, which sigemptyset
    // initialises before sigaddset adds a valid signal number to it.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigaddset(set.as_mut_ptr(), libc::SIGPIPE);
        set.assume_init()
    }
}

/// Whether SIGPIPE is pending for this thread (or the process).
fn pending() -> bool {
    let mut set = MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: sigpending writes a sigset_t into the memory given.
    unsafe {
        libc::sigpending(set.as_mut_ptr()) == 0
            && libc::sigismember(set.as_ptr(), libc::SIGPIPE) == 1
    }
}

/// Blocks SIGPIPE on this thread for good (the library's runtime threads:
/// they never run the engine's code).
pub(crate) fn block_on_this_thread() {
    let set = sigpipe_set();
    // SAFETY: `set` is an initialised sigset_t; the old mask is not asked for.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, ptr::null_mut()) };
}

/// SIGPIPE blocked on the calling thread while this lives.
pub(crate) struct Held {
    /// The caller's mask, restored on drop; None when blocking failed.
    before: Option<libc::sigset_t>,
    /// A SIGPIPE was pending before the call: it is not ours to take.
    was_pending: bool,
}

impl Held {
    pub(crate) fn new() -> Held {
        let set = sigpipe_set();
        let mut before = MaybeUninit::<libc::sigset_t>::zeroed();
        // SAFETY: `set` is initialised; `before` is writable for the old mask.
        let blocked =
            unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, before.as_mut_ptr()) } == 0;
        Held {
            // SAFETY: pthread_sigmask filled `before` when it succeeded.
            before: blocked.then(|| unsafe { before.assume_init() }),
            was_pending: pending(),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(before) = self.before else { return };
        if !self.was_pending && pending() {
            let set = sigpipe_set();
            let no_wait = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: takes the pending SIGPIPE (blocked here) without
            // waiting; `set` and `no_wait` are initialised.
            unsafe { libc::sigtimedwait(&set, ptr::null_mut(), &no_wait) };
        }
        // SAFETY: `before` is the mask pthread_sigmask returned.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, ptr::null_mut()) };
    }
}
