//! TLS for BinX over TCP (rustls, ring): the peer's certificate is checked
//! against a CA bundle, and a client certificate is presented when the
//! server asks for one (mutual TLS).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use thiserror::Error;

/// A TLS setting could not be loaded.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("cannot read {what} from {path}: {detail}")]
    Pem {
        /// What the file should hold ("certificates", "a private key"...).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
    /// rustls refused the combination (e.g. a key that does not match).
    #[error("{0}")]
    Config(String),
}

/// Every certificate in a PEM file; none is an error.
pub fn load_certificates(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let failed = |detail: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        detail,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| failed(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| failed(e.to_string()))?;
    if certs.is_empty() {
        return Err(failed("no CERTIFICATE block in it".into()));
    }
    Ok(certs)
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "a private key",
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// A root store of the CAs in `ca`.
pub fn root_store(ca: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certificates(ca, "CA certificates")? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            what: "CA certificates",
            path: ca.to_path_buf(),
            detail: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The ring provider, whatever the process default is.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Client side: servers are verified against `ca`; `identity` (certificate
/// chain and key files) is presented to servers that require one.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let builder = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(root_store(ca)?);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(
                load_certificates(cert, "a certificate chain")?,
                load_private_key(key)?,
            )
            .map_err(|e| TlsError::Config(format!("client certificate {}: {e}", cert.display())))?,
    };
    Ok(Arc::new(config))
}

/// The name a `host:port` address is verified as: an IP address or a DNS
/// name, brackets of IPv6 literals removed.
pub(crate) fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a name a certificate can be checked against: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_host_port() {
        assert_eq!(
            server_name("127.0.0.1:8091").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        assert_eq!(
            server_name("[::1]:8091").unwrap(),
            ServerName::try_from("::1").unwrap()
        );
        assert_eq!(
            server_name("pod-0.binx.exchange.svc:8091").unwrap(),
            ServerName::try_from("pod-0.binx.exchange.svc").unwrap()
        );
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn missing_and_empty_pem_files_are_named() {
        let err = root_store(Path::new("/no/such/ca.pem")).unwrap_err();
        assert!(err.to_string().contains("/no/such/ca.pem"), "{err}");
        let empty = std::env::temp_dir().join(format!("binx-empty-{}.pem", std::process::id()));
        std::fs::write(&empty, "not pem\n").unwrap();
        let err = root_store(&empty).unwrap_err();
        assert!(err.to_string().contains("no CERTIFICATE"), "{err}");
        let _ = std::fs::remove_file(&empty);
    }
}
