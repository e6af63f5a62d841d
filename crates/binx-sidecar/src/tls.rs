//! binxd's TLS settings, loaded from PEM files: the TCP listener's server
//! configuration (mutual TLS when client certificates are required) and the
//! forwarder's client configuration.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use binx_client::tls::{crypto_provider, load_certificates, load_private_key, root_store};

/// The listener's configuration: `cert` and `key` are binxd's identity;
/// with `client_ca`, clients must present a certificate it signed.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let builder = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(root_store(ca)?),
                crypto_provider(),
            )
            .build()
            .with_context(|| format!("client certificate verifier from {}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(
            load_certificates(cert, "a certificate chain")?,
            load_private_key(key)?,
        )
        .with_context(|| {
            format!(
                "the certificate {} and the key {} do not make a TLS identity",
                cert.display(),
                key.display()
            )
        })?;
    Ok(Arc::new(config))
}
