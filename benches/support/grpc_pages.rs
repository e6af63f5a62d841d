//! The gRPC contender: a tonic server-streaming service over the same
//! buffer manager, the way a gRPC exchange (or Arrow Flight's DoGet) would
//! move a buffer: one call per buffer, one message per chunk, HTTP/2 flow
//! control instead of a request per chunk.
//!
//!     service Pages { rpc Fetch(FetchRequest) returns (stream Chunk); }

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use binx_proto::{BinRequest, MessageType};
use binx_server::Exchange;
use bytes::Bytes;
use futures_util::Stream;
use tonic::body::Body;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

pub(crate) const FETCH: &str = "/binx.bench.v1.Pages/Fetch";
/// Above the 16 MiB chunks (tonic's default limit is 4 MiB).
const MAX_MESSAGE: usize = 64 << 20;

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct FetchRequest {
    #[prost(string, tag = "1")]
    pub task_id: String,
    #[prost(uint64, tag = "2")]
    pub buffer_id: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Chunk {
    #[prost(bytes = "bytes", tag = "1")]
    pub data: Bytes,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<Chunk, Status>> + Send>>;

/// Streams a buffer from the exchange, one chunk per message.
#[derive(Clone)]
pub(crate) struct PagesService {
    pub exchange: Exchange,
}

struct Fetch(Exchange);

impl tonic::server::ServerStreamingService<FetchRequest> for Fetch {
    type Response = Chunk;
    type ResponseStream = ChunkStream;
    type Future = Ready<Result<Response<ChunkStream>, Status>>;

    fn call(&mut self, request: Request<FetchRequest>) -> Self::Future {
        let request = request.into_inner();
        let state = (
            self.0.clone(),
            request,
            0u64,
            VecDeque::<Bytes>::new(),
            false,
        );
        let stream = futures_util::stream::unfold(
            state,
            |(exchange, request, mut token, mut pending, mut done)| async move {
                loop {
                    if let Some(data) = pending.pop_front() {
                        let state = (exchange, request, token, pending, done);
                        return Some((Ok(Chunk { data }), state));
                    }
                    if done {
                        return None;
                    }
                    // Reads on from `token` (acknowledging what came before).
                    let mut data = BinRequest::new(MessageType::Data);
                    data.task_id = request.task_id.clone();
                    data.buffer_id = request.buffer_id;
                    data.page_token = token;
                    data.max_wait_micros = 1_000_000;
                    let reply = exchange.handle_wire(&data, Bytes::new()).await;
                    let status = reply.header.status_kind();
                    if status != binx_proto::Status::Ok && status != binx_proto::Status::NoData {
                        let error = Status::internal(reply.header.error.clone());
                        return Some((Err(error), (exchange, request, token, pending, true)));
                    }
                    pending.extend(reply.body.iter().cloned());
                    token = reply.header.page_next_token;
                    done = reply.header.buffer_complete;
                }
            },
        );
        ready(Ok(Response::new(Box::pin(stream))))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<B> tower_service::Service<http::Request<B>> for PagesService
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != FETCH {
            return Box::pin(ready(Ok(
                Status::unimplemented("no such method").into_http()
            )));
        }
        let exchange = self.exchange.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Chunk, FetchRequest>::default())
                .max_encoding_message_size(MAX_MESSAGE);
            Ok(grpc.server_streaming(Fetch(exchange), request).await)
        })
    }
}

/// Serves the service on `listener` (TCP_NODELAY on each connection, as
/// tonic's own `serve` sets it).
#[allow(dead_code)]
pub(crate) async fn serve(listener: tokio::net::TcpListener, service: PagesService) {
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            stream
        });
        Some((accepted, listener))
    });
    let _ = tonic::transport::Server::builder()
        .serve_with_incoming(service, incoming)
        .await;
}

/// A client on one HTTP/2 connection, shared by every exchange (as BinX
/// shares one TCP connection).
#[allow(dead_code)]
pub(crate) async fn client(addr: &str) -> tonic::client::Grpc<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("address")
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("gRPC connect");
    tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE)
}

/// Pulls one buffer to its end; returns (bytes, messages).
pub(crate) async fn fetch(
    mut grpc: tonic::client::Grpc<Channel>,
    task_id: String,
    buffer_id: u64,
) -> (u64, u64) {
    grpc.ready().await.expect("gRPC ready");
    let mut stream = grpc
        .server_streaming(
            Request::new(FetchRequest { task_id, buffer_id }),
            http::uri::PathAndQuery::from_static(FETCH),
            ProstCodec::<FetchRequest, Chunk>::default(),
        )
        .await
        .expect("gRPC Fetch")
        .into_inner();
    let (mut bytes, mut messages) = (0u64, 0u64);
    while let Some(chunk) = stream.message().await.expect("gRPC message") {
        bytes += chunk.data.len() as u64;
        messages += 1;
    }
    (bytes, messages)
}

/// Serves the service on a Unix socket, as the Flight shared-memory
/// prototype's gRPC baseline does.
#[allow(dead_code)]
pub(crate) async fn serve_unix(listener: tokio::net::UnixListener, service: PagesService) {
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    });
    let _ = tonic::transport::Server::builder()
        .serve_with_incoming(service, incoming)
        .await;
}

/// Connects tonic to a Unix socket path.
#[derive(Clone)]
struct UnixConnector(std::path::PathBuf);

impl tower_service::Service<http::Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            Ok(hyper_util::rt::TokioIo::new(
                tokio::net::UnixStream::connect(path).await?,
            ))
        })
    }
}

/// A client on one HTTP/2 connection over a Unix socket.
#[allow(dead_code)]
pub(crate) async fn client_unix(path: &std::path::Path) -> tonic::client::Grpc<Channel> {
    let channel = tonic::transport::Endpoint::from_static("http://binx.local")
        .connect_with_connector(UnixConnector(path.to_path_buf()))
        .await
        .expect("gRPC connect over the Unix socket");
    tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE)
}
