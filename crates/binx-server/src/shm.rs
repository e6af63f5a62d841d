//! Unix socket connections, which may switch to shared memory: when the
//! first request after the preface is SHM_ATTACH (sent alone), the sidecar
//! creates the regions, answers OK with their descriptors attached
//! (SCM_RIGHTS), and serves the same frames through them from then on
//! (docs/PROTOCOL.md section 6). Any other first request is served on the
//! socket as before.

use std::sync::Arc;

use binx_proto::{BinReply, BinRequest, MessageType, OutFrame, Preface, Status, write_frames};
use binx_shm::{Regions, ShmConfig};
use bytes::BytesMut;
use tokio::net::UnixStream;

use crate::connection::{
    ConnectionConfig, ConnectionError, Link, Refusal, Transport, handshake, serve_frames,
};
use crate::exchange::{ConnectionEvent, Exchange};

/// Serves one accepted Unix socket connection.
pub async fn serve_unix(
    stream: UnixStream,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
) -> Result<(), ConnectionError> {
    let (reader, writer) = stream.into_split();
    let (reader, writer, peer) = handshake(reader, writer, &config).await?;
    let mut frames = config.frame_reader::<_, BinRequest>(&exchange, reader);
    // The first request, like any later one, within idle_timeout: a local
    // peer that says nothing must not hold a connection slot for good.
    let first = match config.idle_timeout {
        None => frames.next().await,
        Some(idle) => match tokio::time::timeout(idle, frames.next()).await {
            Ok(first) => first,
            Err(_) => {
                exchange.count(ConnectionEvent::TimedOut);
                return Err(ConnectionError::IdleTimeout(idle));
            }
        },
    };
    let Some(first) = first else {
        return Ok(());
    };
    // A client that sent more before the reply (SHM_ATTACH not alone) is
    // served on the socket, and its SHM_ATTACH refused: what it sent next
    // would be lost between the socket and the regions.
    let attach = match (&first, &config.shm, &refusal) {
        (Ok(frame), Some(shm), None)
            if frame.header.message_type() == Ok(MessageType::ShmAttach)
                && frames.buffered() == 0 =>
        {
            Some((frame.header.clone(), shm.clone()))
        }
        _ => None,
    };
    let Some((request, shm)) = attach else {
        return serve_frames(
            frames,
            Some(first),
            writer,
            Link {
                transport: Transport::Uds,
                peer,
            },
            exchange,
            config,
            refusal,
            None,
        )
        .await;
    };
    let (reader, _) = frames.into_parts();
    let stream = reader
        .reunite(writer)
        .map_err(|e| ConnectionError::Io(std::io::Error::other(e.to_string())))?;
    attach_and_serve(stream, request, shm, exchange, config).await
}

async fn attach_and_serve(
    stream: UnixStream,
    request: BinRequest,
    shm: ShmConfig,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
) -> Result<(), ConnectionError> {
    // The regions count against a limit of their own.
    if !exchange.try_reserve_shm(config.shm_max_connections) {
        let reply = BinReply::error(
            &request,
            Status::Busy,
            format!(
                "{} shared memory connections are attached, the limit (shm_max_connections); keep using the Unix socket",
                config.shm_max_connections
            ),
        );
        return stay_on_socket(stream, reply, exchange, config).await;
    }
    let slot = ShmSlot(exchange.clone());
    attach_reserved(stream, request, shm, exchange, config, slot).await
}

/// A shared memory slot, given back when the connection ends however it
/// ends.
struct ShmSlot(Exchange);

impl Drop for ShmSlot {
    fn drop(&mut self) {
        self.0.release_shm();
    }
}

/// Answers an SHM_ATTACH that was refused, then serves the connection on
/// the socket.
async fn stay_on_socket(
    stream: UnixStream,
    reply: BinReply,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
) -> Result<(), ConnectionError> {
    exchange.record_reply(&reply);
    let (reader, mut writer) = stream.into_split();
    write_frames(&mut writer, [OutFrame::new(reply)], &mut BytesMut::new()).await?;
    let frames = config.frame_reader(&exchange, reader);
    // SHM_ATTACH is a 1.1 request: its sender speaks 1.1.
    let link = Link {
        transport: Transport::Uds,
        peer: Preface::CURRENT,
    };
    serve_frames(frames, None, writer, link, exchange, config, None, None).await
}

async fn attach_reserved(
    stream: UnixStream,
    request: BinRequest,
    shm: ShmConfig,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    slot: ShmSlot,
) -> Result<(), ConnectionError> {
    let regions = match Regions::create(&shm) {
        Ok(regions) => regions,
        Err(e) => {
            // The connection stays on the socket: its slot is free again.
            drop(slot);
            // Out of memory or descriptors: say so and stay on the socket.
            tracing::warn!(error = %e, "could not create shared memory regions");
            let reply = BinReply::error(
                &request,
                Status::ServerError,
                format!(
                    "binxd could not create shared memory regions: {e}; keep using the Unix socket"
                ),
            );
            return stay_on_socket(stream, reply, exchange, config).await;
        }
    };
    let reply = encode_now(BinReply::to(&request, Status::Ok));
    binx_shm::pass::send_with_fds(&stream, &reply, &regions.fds())
        .await
        .map_err(|e| ConnectionError::Io(e.into()))?;
    let layout = *regions.layout();
    let farewell: binx_shm::stream::Farewell = Box::new(|fault: &str| {
        let header = BinReply {
            status: Status::BadRequest as i32,
            error: format!("closing the shared memory connection: {fault}"),
            ..Default::default()
        };
        encode_now(header)
    });
    let (reader, writer, _link) = binx_shm::serve(regions, stream, shm.spin, Some(farewell))
        .map_err(|e| ConnectionError::Io(e.into()))?;
    exchange.count(ConnectionEvent::ShmAttached);
    tracing::debug!(
        slots = layout.slot_count,
        slot_size = layout.slot_size,
        "a Unix socket client attached shared memory"
    );
    let frames = config.frame_reader(&exchange, reader);
    let result = serve_frames(
        frames,
        None,
        writer,
        // SHM_ATTACH is a 1.1 request: its sender speaks 1.1.
        Link {
            transport: Transport::SharedMemory,
            peer: Preface::CURRENT,
        },
        exchange.clone(),
        config,
        None,
        None,
    )
    .await;
    exchange.count(ConnectionEvent::ShmDetached);
    result
}

/// The bytes of a frame without a body (an empty vector if the header
/// cannot be encoded, which our own replies always can).
fn encode_now(header: BinReply) -> Vec<u8> {
    let mut head = BytesMut::new();
    match binx_proto::encode_frame_head(&header, 0, &mut head) {
        Ok(()) => head.to_vec(),
        Err(_) => Vec::new(),
    }
}
