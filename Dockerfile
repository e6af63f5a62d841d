# binxd and the binx CLI in a small non-root image.
#   docker build -t binxd .
#   docker run --rm -p 8091:8091 -p 8090:8090 binxd
# The CLI is in the image because the Helm chart's preStop hook runs
# `binx drain`.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# zstd and ring build C code.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cargo build --release --locked -p binx --bins \
    && mkdir -p /out \
    && cp target/release/binxd target/release/binx /out/

# glibc, libgcc and CA certificates (for S3, GCS and Azure over TLS); no
# shell, no package manager; uid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/binxd /out/binx /usr/local/bin/
USER 65532:65532
EXPOSE 8091 8090
# Listen beyond loopback when run on its own. The Helm chart replaces these
# arguments with --config; keys are not set through ENV here, because
# environment variables would override the chart's binxd.toml.
ENTRYPOINT ["/usr/local/bin/binxd"]
CMD ["--tcp-listen", "0.0.0.0:8091", "--http-listen", "0.0.0.0:8090"]
