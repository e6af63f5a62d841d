//! Kernel TLS for the BinX TCP listener: rustls does the
//! handshake, then hands the connection's traffic keys to the kernel
//! (`setsockopt(TCP_ULP, "tls")`, `TLS_TX`, `TLS_RX`), which encrypts on
//! `write` and decrypts on `read`. Replies then leave with the same
//! vectored writes as plain TCP, without rustls copying every byte into a
//! record buffer first.
//!
//! Where the kernel does not offer it (no `tls` module, an old kernel, a
//! cipher suite it lacks) the connection stays with rustls: the probe at
//! bind time says which suites the kernel takes, and a connection whose
//! suite it does not take never has its keys extracted.
//!
//! The one hazard is bytes read past the handshake: anything rustls reads
//! from the socket after the client's `Finished` would be lost to the
//! kernel. [`RecordReader`] therefore gives rustls one TLS record at a time
//! during the handshake, so the handshake ends exactly at a record boundary
//! and every later record is still in the socket when the keys go in.

#![deny(clippy::undocumented_unsafe_blocks)]

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rustls::rustls::{self, ConnectionTrafficSecrets, ProtocolVersion, ServerConnection};

const SOL_TCP: libc::c_int = 6;
const TCP_ULP: libc::c_int = 31;
const SOL_TLS: libc::c_int = 282;
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
const TLS_SET_RECORD_TYPE: libc::c_int = 1;
const TLS_GET_RECORD_TYPE: libc::c_int = 2;

const TLS_1_3: u16 = 0x0304;
const CIPHER_AES_GCM_128: u16 = 51;
const CIPHER_AES_GCM_256: u16 = 52;
const CIPHER_CHACHA20_POLY1305: u16 = 54;

/// TLS record content types (RFC 8446 section 5.1).
const RECORD_ALERT: u8 = 21;
const RECORD_HANDSHAKE: u8 = 22;
const RECORD_APPLICATION_DATA: u8 = 23;
/// Alert descriptions (RFC 8446 section 6).
const CLOSE_NOTIFY: u8 = 0;
const USER_CANCELED: u8 = 90;
/// user_canceled alerts let pass on one connection.
const MAX_WARNING_ALERTS: u32 = 4;
/// Records one key may seal before a connection must end: AES-GCM's
/// confidentiality limit for TLS 1.3 (RFC 8446 section 5.5), as rustls
/// counts it. The kernel does not rekey, so binxd closes the connection
/// instead and the client reconnects.
const MAX_SEALED_RECORDS: u64 = 1 << 24;
/// Largest TLS record payload (2^14).
const MAX_RECORD_PAYLOAD: u64 = 1 << 14;
/// Largest TLS record body a peer may send (TLS 1.2's 2^14 + 2048).
const MAX_RECORD_BODY: usize = (1 << 14) + 2048;

/// One (protocol version, kernel cipher) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Suite {
    version: u16,
    cipher: u16,
}

/// TLS 1.3 only. TLS 1.2's AES-GCM nonce is `salt || explicit`, and rustls
/// and the kernel derive the explicit part differently (rustls XORs it with
/// the sequence number, the kernel counts up from it), so handing a TLS 1.2
/// connection over could reuse a nonce rustls already sealed under: TLS 1.2
/// connections stay with rustls.
const PROBED: [Suite; 3] = [
    Suite {
        version: TLS_1_3,
        cipher: CIPHER_AES_GCM_128,
    },
    Suite {
        version: TLS_1_3,
        cipher: CIPHER_AES_GCM_256,
    },
    Suite {
        version: TLS_1_3,
        cipher: CIPHER_CHACHA20_POLY1305,
    },
];

/// What the kernel offers, found once when the listener binds.
#[derive(Clone, Debug, Default)]
pub struct KernelTls {
    suites: Vec<Suite>,
    /// Why nothing is offered, when nothing is.
    unavailable: Option<String>,
}

impl KernelTls {
    /// Tries each suite on a loopback connection of its own (the kernel
    /// takes keys for one suite per socket, in both directions).
    pub fn probe() -> KernelTls {
        let mut suites = Vec::new();
        let mut unavailable = None;
        for suite in PROBED {
            match probe_suite(suite) {
                Ok(()) => suites.push(suite),
                Err(e) => {
                    if unavailable.is_none() {
                        unavailable = Some(e.to_string());
                    }
                }
            }
        }
        KernelTls {
            unavailable: suites
                .is_empty()
                .then(|| unavailable.unwrap_or_else(|| "no cipher suite was accepted".to_string())),
            suites,
        }
    }

    /// Whether any suite can go to the kernel.
    pub fn offered(&self) -> bool {
        !self.suites.is_empty()
    }

    /// Why no suite can, when none can.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    fn takes(&self, suite: Suite) -> bool {
        self.suites.contains(&suite)
    }
}

fn probe_suite(suite: Suite) -> io::Result<()> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let client = std::net::TcpStream::connect(listener.local_addr()?)?;
    // Kept open: the kernel takes the ULP only on an established socket.
    let (server, _) = listener.accept()?;
    let fd = server.as_raw_fd();
    set_ulp(fd)?;
    let key_len = match suite.cipher {
        CIPHER_AES_GCM_128 => 16,
        _ => 32,
    };
    for direction in [TLS_TX, TLS_RX] {
        let mut info = crypto_info(suite, &vec![0; key_len], &[0; 12], 0)?;
        let result = set_crypto(fd, direction, &info);
        wipe(&mut info);
        result?;
    }
    drop(client);
    Ok(())
}

fn set_ulp(fd: RawFd) -> io::Result<()> {
    // SAFETY: fd is an open socket; the option value is 3 valid bytes.
    let r = unsafe { libc::setsockopt(fd, SOL_TCP, TCP_ULP, b"tls".as_ptr().cast(), 3) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!(
                "the kernel refused the TLS upper layer protocol (is the tls module there?): {e}"
            ),
        ));
    }
    Ok(())
}

fn set_crypto(fd: RawFd, direction: libc::c_int, info: &[u8]) -> io::Result<()> {
    // SAFETY: fd is an open socket; info is a live buffer of info.len() bytes
    // laid out as the kernel's tls12_crypto_info_* struct.
    let r = unsafe {
        libc::setsockopt(
            fd,
            SOL_TLS,
            direction,
            info.as_ptr().cast(),
            info.len() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's `tls12_crypto_info_*` for one direction, byte for byte:
/// version and cipher (native u16s), then for AES-GCM iv[8], key, salt[4],
/// rec_seq[8]; for ChaCha20-Poly1305 iv[12], key[32], rec_seq[8]. No
/// padding: every field after the two u16s is a byte array.
fn crypto_info(suite: Suite, key: &[u8], iv: &[u8], seq: u64) -> io::Result<Vec<u8>> {
    let bad = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cipher {} for kernel TLS: {what}", suite.cipher),
        )
    };
    if iv.len() != 12 {
        return Err(bad("the IV is not 12 bytes"));
    }
    let mut info = Vec::with_capacity(64);
    info.extend_from_slice(&suite.version.to_ne_bytes());
    info.extend_from_slice(&suite.cipher.to_ne_bytes());
    match suite.cipher {
        CIPHER_AES_GCM_128 | CIPHER_AES_GCM_256 => {
            let want = if suite.cipher == CIPHER_AES_GCM_128 {
                16
            } else {
                32
            };
            if key.len() != want {
                return Err(bad("wrong key length"));
            }
            info.extend_from_slice(&iv[4..]);
            info.extend_from_slice(key);
            info.extend_from_slice(&iv[..4]);
        }
        CIPHER_CHACHA20_POLY1305 => {
            if key.len() != 32 {
                return Err(bad("wrong key length"));
            }
            info.extend_from_slice(iv);
            info.extend_from_slice(key);
        }
        _ => return Err(bad("not a cipher binx hands to the kernel")),
    }
    info.extend_from_slice(&seq.to_be_bytes());
    Ok(info)
}

/// Overwrites key material before its buffer is freed.
fn wipe(bytes: &mut [u8]) {
    for b in bytes.iter_mut() {
        // SAFETY: b is a valid, aligned &mut u8; volatile so the store stays.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
}

/// The suite of a finished handshake in the kernel's terms, with its key
/// and IV for one direction.
fn kernel_suite(
    version: Option<ProtocolVersion>,
    secrets: &ConnectionTrafficSecrets,
) -> Option<(Suite, Vec<u8>, Vec<u8>)> {
    let version = match version? {
        ProtocolVersion::TLSv1_3 => TLS_1_3,
        _ => return None,
    };
    let (cipher, key, iv) = match secrets {
        // The key length, not the variant, says which AES.
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
            let cipher = match key.as_ref().len() {
                16 => CIPHER_AES_GCM_128,
                32 => CIPHER_AES_GCM_256,
                _ => return None,
            };
            (cipher, key.as_ref().to_vec(), iv.as_ref().to_vec())
        }
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (
            CIPHER_CHACHA20_POLY1305,
            key.as_ref().to_vec(),
            iv.as_ref().to_vec(),
        ),
        _ => return None,
    };
    Some((Suite { version, cipher }, key, iv))
}

/// The suite a handshake negotiated, as the kernel would name it, without
/// touching its secrets: decides whether to try the kernel at all.
fn negotiated_suite(conn: &ServerConnection) -> Option<Suite> {
    use rustls::CipherSuite as C;
    let version = match conn.protocol_version()? {
        ProtocolVersion::TLSv1_3 => TLS_1_3,
        _ => return None,
    };
    let cipher = match conn.negotiated_cipher_suite()?.suite() {
        C::TLS13_AES_128_GCM_SHA256 => CIPHER_AES_GCM_128,
        C::TLS13_AES_256_GCM_SHA384 => CIPHER_AES_GCM_256,
        C::TLS13_CHACHA20_POLY1305_SHA256 => CIPHER_CHACHA20_POLY1305,
        _ => return None,
    };
    Some(Suite { version, cipher })
}

/// Why a connection could not go to the kernel after its keys were taken
/// from rustls (the connection is lost then).
#[derive(Debug, thiserror::Error)]
#[error("kernel TLS: {0}")]
pub struct KernelTlsError(String);

/// A TLS connection after the handshake: in the kernel, or still rustls.
pub enum Secured {
    /// The kernel took the keys: the connection's two halves, which read and
    /// write plaintext while the kernel does the TLS records.
    Kernel(KernelReader, KernelWriter),
    /// The kernel does not take the negotiated suite: the stream stays with
    /// rustls.
    Rustls(Box<tokio_rustls::server::TlsStream<RecordReader>>),
}

/// Moves a finished handshake's connection into the kernel when the kernel
/// takes its suite; otherwise hands it back to be served by rustls.
pub async fn secure(
    mut stream: tokio_rustls::server::TlsStream<RecordReader>,
    kernel: &KernelTls,
) -> Result<Secured, KernelTlsError> {
    let suite = negotiated_suite(stream.get_ref().1);
    // The upper layer protocol first: until keys are set it passes bytes
    // through unchanged, so if the kernel refuses it rustls goes on.
    let wanted = suite.is_some_and(|s| kernel.takes(s))
        && set_ulp(stream.get_ref().0.io.as_raw_fd()).is_ok();
    if !wanted {
        stream.get_mut().0.pass_through();
        return Ok(Secured::Rustls(Box::new(stream)));
    }
    // Whatever the handshake still has to send (session tickets) goes out
    // through rustls first.
    {
        use tokio::io::AsyncWriteExt;
        stream
            .flush()
            .await
            .map_err(|e| KernelTlsError(format!("flushing the handshake: {e}")))?;
    }
    let (mut io, mut conn) = stream.into_inner();
    // tokio-rustls reads on after the client's Finished until the socket
    // would block, so rustls may hold records that came after it, the last
    // perhaps in part (reads never cross a record's end, see RecordReader).
    // That record is read to its end and handed to rustls, so the kernel
    // starts at a record boundary.
    {
        use tokio::io::AsyncReadExt;
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            KernelTlsError(format!(
                "finishing the record after the handshake: {what}: {e}"
            ))
        };
        let mut chunk = [0u8; 4096];
        while io.mid_record() {
            let n = io.read(&mut chunk).await.map_err(|e| fail("read", &e))?;
            if n == 0 {
                return Err(fail("read", &"the peer closed inside a record"));
            }
            let mut rest = &chunk[..n];
            while !rest.is_empty() {
                conn.read_tls(&mut rest).map_err(|e| fail("rustls", &e))?;
                conn.process_new_packets().map_err(|e| fail("rustls", &e))?;
            }
        }
    }
    // Nothing rustls owes the peer may be left (its sequence numbers go to
    // the kernel as they are).
    if conn.wants_write() {
        return Err(KernelTlsError(
            "rustls has TLS records to send after the handshake".into(),
        ));
    }
    // Plaintext rustls decrypted from those records is served before the
    // socket; a close_notify among them ends the stream there.
    let mut drained = Vec::new();
    let mut closed = false;
    {
        use std::io::Read;
        let mut chunk = [0u8; 4096];
        loop {
            match conn.reader().read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => drained.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(KernelTlsError(format!("draining rustls: {e}"))),
            }
        }
    }
    let tcp = io.into_inner();
    let fd = tcp.as_raw_fd();
    let version = conn.protocol_version();
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| KernelTlsError(format!("rustls gave no traffic secrets: {e}")))?;
    for (direction, (seq, secret)) in [(TLS_TX, secrets.tx), (TLS_RX, secrets.rx)] {
        let Some((suite, mut key, mut iv)) = kernel_suite(version, &secret) else {
            return Err(KernelTlsError(
                "a cipher suite the kernel was not probed for".into(),
            ));
        };
        let info = crypto_info(suite, &key, &iv, seq);
        wipe(&mut key);
        wipe(&mut iv);
        let mut info = info.map_err(|e| KernelTlsError(e.to_string()))?;
        let set = set_crypto(fd, direction, &info);
        wipe(&mut info);
        set.map_err(|e| {
            KernelTlsError(format!(
                "the kernel refused the {} key: {e}",
                if direction == TLS_TX {
                    "send"
                } else {
                    "receive"
                }
            ))
        })?;
    }
    let (read, write) = tcp.into_split();
    Ok(Secured::Kernel(
        KernelReader {
            half: read,
            drained,
            drained_at: 0,
            closed,
            warnings: 0,
        },
        KernelWriter {
            half: write,
            close_notify_sent: false,
            records: 0,
        },
    ))
}

// ------------------------------------------------------------ handshake reader

enum RecordState {
    /// Reading a record header; `have` of its 5 bytes so far.
    Header { bytes: [u8; 5], have: usize },
    /// Inside a record body; `left` bytes of it still to read.
    Body { left: usize },
    /// After the handshake, served by rustls: reads go straight through.
    PassThrough,
}

/// The TCP stream under rustls during the handshake: each read returns at
/// most the rest of the current TLS record, so rustls never holds bytes of
/// the record after the one that ends the handshake.
pub struct RecordReader {
    io: TcpStream,
    state: RecordState,
}

impl RecordReader {
    /// Record by record (`kernel`: keys may go to the kernel after the
    /// handshake), or straight through.
    pub fn new(io: TcpStream, kernel: bool) -> Self {
        RecordReader {
            io,
            state: if kernel {
                RecordState::Header {
                    bytes: [0; 5],
                    have: 0,
                }
            } else {
                RecordState::PassThrough
            },
        }
    }

    /// Reads go straight through from now on.
    pub fn pass_through(&mut self) {
        self.state = RecordState::PassThrough;
    }

    /// Whether a record is partly read.
    fn mid_record(&self) -> bool {
        match self.state {
            RecordState::Header { have, .. } => have > 0,
            RecordState::Body { .. } => true,
            RecordState::PassThrough => false,
        }
    }

    fn into_inner(self) -> TcpStream {
        self.io
    }
}

impl AsyncRead for RecordReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        // Handshake records are small: a bounce buffer keeps this safe code.
        match &mut this.state {
            RecordState::PassThrough => Pin::new(&mut this.io).poll_read(cx, buf),
            RecordState::Header { bytes, have } => {
                let want = (5 - *have).min(buf.remaining());
                let mut bounce = [0u8; 5];
                let mut part = ReadBuf::new(&mut bounce[..want]);
                ready!(Pin::new(&mut this.io).poll_read(cx, &mut part))?;
                let got = part.filled();
                buf.put_slice(got);
                bytes[*have..*have + got.len()].copy_from_slice(got);
                *have += got.len();
                if *have == 5 {
                    let len = u16::from_be_bytes([bytes[3], bytes[4]]) as usize;
                    this.state = if len == 0 {
                        RecordState::Header {
                            bytes: [0; 5],
                            have: 0,
                        }
                    } else if len > MAX_RECORD_BODY {
                        // Not TLS: let rustls see it and refuse it.
                        RecordState::PassThrough
                    } else {
                        RecordState::Body { left: len }
                    };
                }
                Poll::Ready(Ok(()))
            }
            RecordState::Body { left } => {
                let mut bounce = [0u8; 4096];
                let want = (*left).min(buf.remaining()).min(bounce.len());
                let mut part = ReadBuf::new(&mut bounce[..want]);
                ready!(Pin::new(&mut this.io).poll_read(cx, &mut part))?;
                let got = part.filled();
                buf.put_slice(got);
                *left -= got.len();
                if *left == 0 {
                    this.state = RecordState::Header {
                        bytes: [0; 5],
                        have: 0,
                    };
                }
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for RecordReader {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

// ------------------------------------------------------------ kernel halves

/// Reads application data the kernel decrypted. Other records come with
/// their type in a control message: close_notify ends the stream, other
/// alerts and post-handshake messages (a key update the kernel cannot
/// follow) end it with an error.
pub struct KernelReader {
    half: OwnedReadHalf,
    drained: Vec<u8>,
    drained_at: usize,
    closed: bool,
    /// user_canceled alerts let pass so far.
    warnings: u32,
}

/// Bytes of control buffer: `CMSG_SPACE(1)` is 24 on 64-bit Linux.
const CONTROL_BYTES: usize = 64;

/// Room for one control message with one byte (the TLS record type),
/// aligned as `cmsghdr` wants, and the `msghdr` that points at it.
#[repr(C)]
struct Control {
    buf: [u64; CONTROL_BYTES / 8],
    msg: libc::msghdr,
}

impl Default for Control {
    fn default() -> Self {
        Control {
            buf: [0; CONTROL_BYTES / 8],
            // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
            msg: unsafe { std::mem::zeroed() },
        }
    }
}

impl Control {
    /// A message of one `iov` with `len` bytes of this control buffer
    /// (at most its size).
    fn message(&mut self, iov: &mut libc::iovec, len: usize) -> &mut libc::msghdr {
        self.msg.msg_iov = iov;
        self.msg.msg_iovlen = 1;
        self.msg.msg_control = self.buf.as_mut_ptr().cast();
        self.msg.msg_controllen = len.min(CONTROL_BYTES) as _;
        &mut self.msg
    }
}

/// One `recvmsg` into `buf`: bytes read and the record type they came in.
fn recv_record(fd: RawFd, buf: &mut [std::mem::MaybeUninit<u8>]) -> io::Result<(usize, u8)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = Control::default();
    let msg = control.message(&mut iov, CONTROL_BYTES);
    // SAFETY: msg points at live iov and control buffers of the given sizes;
    // the kernel writes at most iov_len bytes into buf.
    let n = unsafe { libc::recvmsg(fd, msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut record = RECORD_APPLICATION_DATA;
    // SAFETY: CMSG_* walk the control buffer the kernel filled, within
    // msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == SOL_TLS && (*cmsg).cmsg_type == TLS_GET_RECORD_TYPE {
                record = *libc::CMSG_DATA(cmsg);
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    Ok((n as usize, record))
}

impl AsyncRead for KernelReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.drained_at < this.drained.len() {
            let rest = &this.drained[this.drained_at..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.drained_at += n;
            return Poll::Ready(Ok(()));
        }
        loop {
            let stream: &TcpStream = this.half.as_ref();
            ready!(stream.poll_read_ready(cx))?;
            let fd = stream.as_raw_fd();
            // SAFETY: recvmsg writes only initialized bytes, and only the
            // n it reports are marked filled below.
            let unfilled = unsafe { buf.unfilled_mut() };
            match stream.try_io(Interest::READABLE, || recv_record(fd, unfilled)) {
                Ok((n, RECORD_APPLICATION_DATA)) => {
                    // SAFETY: the kernel wrote these n bytes.
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok((n, RECORD_ALERT)) => {
                    // SAFETY: the kernel wrote these n bytes.
                    let alert: Vec<u8> = unfilled[..n.min(2)]
                        .iter()
                        .map(|b| unsafe { b.assume_init() })
                        .collect();
                    match alert.as_slice() {
                        [_, CLOSE_NOTIFY] => {
                            this.closed = true;
                            return Poll::Ready(Ok(()));
                        }
                        // TLS 1.3: every alert but close_notify and
                        // user_canceled is fatal; a few of the latter are
                        // let pass, as rustls does.
                        [_, USER_CANCELED] if this.warnings < MAX_WARNING_ALERTS => {
                            this.warnings += 1;
                            continue;
                        }
                        [_, description] => {
                            this.closed = true;
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::ConnectionAborted,
                                format!("the peer sent TLS alert {description}"),
                            )));
                        }
                        _ => {
                            this.closed = true;
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "the peer sent a TLS alert shorter than 2 bytes",
                            )));
                        }
                    }
                }
                Ok((_, RECORD_HANDSHAKE)) => {
                    this.closed = true;
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the peer sent a TLS handshake message after the handshake (a key update?), which this kernel TLS connection cannot follow",
                    )));
                }
                Ok((_, other)) => {
                    this.closed = true;
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the peer sent a TLS record of type {other}"),
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBADMSG) => {
                    this.closed = true;
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a TLS record failed authentication (corrupted or forged)",
                    )));
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Writes go to the kernel, which seals them into records; shutting down
/// sends close_notify first.
pub struct KernelWriter {
    half: OwnedWriteHalf,
    close_notify_sent: bool,
    /// At least the records the kernel sealed so far: each write is cut
    /// into records of at most 2^14 bytes, the last one partial.
    records: u64,
}

impl KernelWriter {
    fn check_key_limit(&self) -> io::Result<()> {
        if self.records >= MAX_SEALED_RECORDS {
            return Err(io::Error::other(
                "kernel TLS: this connection's key sealed 2^24 records, the AES-GCM limit; reconnect for a new key",
            ));
        }
        Ok(())
    }

    fn count(&mut self, written: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = written {
            self.records += (*n as u64).div_ceil(MAX_RECORD_PAYLOAD).max(1);
        }
    }
}

fn send_close_notify(fd: RawFd) -> io::Result<()> {
    let mut alert = [1u8, CLOSE_NOTIFY];
    let mut iov = libc::iovec {
        iov_base: alert.as_mut_ptr().cast(),
        iov_len: alert.len(),
    };
    let mut control = Control::default();
    // SAFETY: CMSG_SPACE is pure arithmetic.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    let msg = control.message(&mut iov, space);
    // SAFETY: the control buffer holds CMSG_SPACE(1) bytes, so the first
    // header and its one data byte fit.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(msg);
        if cmsg.is_null() {
            return Err(io::Error::other("no room for the record type"));
        }
        (*cmsg).cmsg_level = SOL_TLS;
        (*cmsg).cmsg_type = TLS_SET_RECORD_TYPE;
        (*cmsg).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(cmsg) = RECORD_ALERT;
    }
    // SAFETY: msg points at live buffers of the given sizes.
    let n = unsafe { libc::sendmsg(fd, msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsyncWrite for KernelWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_key_limit()?;
        let written = Pin::new(&mut this.half).poll_write(cx, buf);
        this.count(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_key_limit()?;
        let written = Pin::new(&mut this.half).poll_write_vectored(cx, bufs);
        this.count(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.half.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().half).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        while !this.close_notify_sent {
            let stream: &TcpStream = this.half.as_ref();
            ready!(stream.poll_write_ready(cx))?;
            let fd = stream.as_raw_fd();
            match stream.try_io(Interest::WRITABLE, || send_close_notify(fd)) {
                Ok(()) => this.close_notify_sent = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // The peer is gone: nothing to notify.
                Err(_) => this.close_notify_sent = true,
            }
        }
        Pin::new(&mut this.half).poll_shutdown(cx)
    }
}

/// rustls must allow the keys out for the kernel to have them.
pub fn allow_secret_extraction(
    config: &std::sync::Arc<rustls::ServerConfig>,
) -> std::sync::Arc<rustls::ServerConfig> {
    let mut config = (**config).clone();
    config.enable_secret_extraction = true;
    std::sync::Arc::new(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crypto_info_matches_the_kernel_layout() {
        let key: Vec<u8> = (0..16).collect();
        let iv: Vec<u8> = (100..112).collect();
        let suite = Suite {
            version: TLS_1_3,
            cipher: CIPHER_AES_GCM_128,
        };
        let info = crypto_info(suite, &key, &iv, 0x0102_0304_0506_0708).unwrap();
        // struct tls12_crypto_info_aes_gcm_128: 2 + 2 + 8 + 16 + 4 + 8.
        assert_eq!(info.len(), 40);
        assert_eq!(&info[0..2], &TLS_1_3.to_ne_bytes());
        assert_eq!(&info[2..4], &CIPHER_AES_GCM_128.to_ne_bytes());
        assert_eq!(&info[4..12], &iv[4..]);
        assert_eq!(&info[12..28], &key[..]);
        assert_eq!(&info[28..32], &iv[..4]);
        assert_eq!(&info[32..40], &[1, 2, 3, 4, 5, 6, 7, 8]);
        let chacha = Suite {
            version: TLS_1_3,
            cipher: CIPHER_CHACHA20_POLY1305,
        };
        let info = crypto_info(chacha, &[7; 32], &iv, 9).unwrap();
        // struct tls12_crypto_info_chacha20_poly1305: 2 + 2 + 12 + 32 + 8.
        assert_eq!(info.len(), 56);
        assert_eq!(&info[4..16], &iv[..]);
        assert!(crypto_info(suite, &[0; 32], &iv, 0).is_err());
        assert!(crypto_info(suite, &key, &iv[..8], 0).is_err());
    }

    #[tokio::test]
    async fn the_record_reader_stops_at_each_record_end() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        // Two records (bodies of 3 and 300 bytes) and the start of a third.
        let mut bytes = vec![22, 3, 3, 0, 3, 1, 2, 3, 23, 3, 3, 1, 44];
        bytes.extend(std::iter::repeat_n(9u8, 300));
        bytes.extend([23, 3, 3]);
        client.write_all(&bytes).await.unwrap();
        let mut reader = RecordReader::new(server, true);
        let mut got = Vec::new();
        let mut reads = Vec::new();
        while got.len() < bytes.len() - 3 {
            let mut buf = [0u8; 8192];
            let n = reader.read(&mut buf).await.unwrap();
            reads.push(n);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, bytes[..bytes.len() - 3]);
        assert!(!reader.mid_record(), "reads {reads:?}");
        // No read crossed a record boundary: headers alone, then bodies.
        let mut at = 0;
        for n in reads {
            let ends = [5, 8, 13, 313];
            assert!(ends.contains(&(at + n)), "a read ended at {}", at + n);
            at += n;
        }
    }

    #[test]
    fn the_probe_says_why_when_the_kernel_offers_nothing() {
        let kernel = KernelTls::probe();
        assert_eq!(kernel.offered(), kernel.unavailable().is_none());
    }
}
