//! Resolving a `host:port` to the one address it names: the only part of
//! the transport's vocabulary that does I/O (a DNS lookup on the runtime),
//! kept apart from the names the core keys its tables by.

use super::{PeerAddr, ResolveError};

/// Whether `host` is made of numbers only (decimal or `0x` hex parts
/// between dots) without being a standard dotted-quad IPv4 literal: the
/// forms `inet_aton` reads its own way (octal, hex, fewer parts).
fn is_nonstandard_numeric_host(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    let numeric_part = |part: &str| {
        let part = part.to_ascii_lowercase();
        match part.strip_prefix("0x") {
            Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
            None => !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()),
        }
    };
    !host.is_empty()
        && host.split('.').all(numeric_part)
        && host.parse::<std::net::Ipv4Addr>().is_err()
}

impl PeerAddr {
    /// Resolves a `host:port` to the one socket address it names, in its
    /// canonical form: aliases of one prefill (`localhost:5600`,
    /// `127.0.0.1:5600`) become one address, so the service sees one
    /// peer. A name that resolves to several addresses is refused
    /// ([`ResolveError::Ambiguous`]), never guessed. IP literals are not
    /// looked up.
    ///
    /// A host made only of numbers (and dots, or `0x` parts) that is not a
    /// standard IPv4 literal is refused ([`ResolveError::NumericHost`]):
    /// the lookup would hand it to the C resolver, which reads `010` as
    /// octal and `2130706433` as one 32-bit number. The port is decimal
    /// digits only (`05600` is `5600`; a sign is refused).
    pub async fn resolve(address: &str) -> Result<PeerAddr, ResolveError> {
        let form = || ResolveError::Form(crate::text::Escaped(address).to_string());
        let (host, port) = address.rsplit_once(':').ok_or_else(form)?;
        if host.is_empty()
            || port.is_empty()
            || !port.bytes().all(|b| b.is_ascii_digit())
            || port.parse::<u16>().is_err()
        {
            return Err(form());
        }
        if is_nonstandard_numeric_host(host) {
            return Err(ResolveError::NumericHost(
                crate::text::Escaped(address).to_string(),
            ));
        }
        let port: u16 = port.parse().map_err(|_| form())?;
        let literal = PeerAddr::new(format!("{host}:{port}"));
        if literal.as_str().parse::<std::net::SocketAddr>().is_ok() {
            return Ok(literal);
        }
        let mut resolved: Vec<std::net::SocketAddr> = tokio::net::lookup_host(address)
            .await
            .map_err(|source| ResolveError::Lookup {
                address: address.to_string(),
                source,
            })?
            .collect();
        resolved.sort();
        resolved.dedup();
        match resolved.as_slice() {
            [one] => Ok(PeerAddr::new(one.to_string())),
            [] => Err(ResolveError::Lookup {
                address: address.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            }),
            _ => Err(ResolveError::Ambiguous {
                address: address.to_string(),
                resolved,
            }),
        }
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::{PeerAddr, ResolveError};

    #[tokio::test]
    async fn a_numeric_host_that_is_not_a_standard_ipv4_literal_is_refused_naming_the_form() {
        for address in [
            "010.000.000.001:5600",
            "010.0.0.1:5600",
            "127.000.0.1:5600",
            "2130706433:5600",
            "127.1:5600",
            "0x7f.0.0.1:5600",
            "1.2.3.4.5:5600",
        ] {
            match PeerAddr::resolve(address).await {
                Err(ResolveError::NumericHost(shown)) => {
                    assert_eq!(shown, address);
                    let text = ResolveError::NumericHost(shown).to_string();
                    assert!(text.contains("standard IPv4"), "{text}");
                }
                other => panic!("{address}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn standard_literals_are_kept_and_the_port_is_written_canonically() {
        let ok = |a: &str| a.to_string();
        assert_eq!(
            PeerAddr::resolve("10.0.0.1:5600").await.unwrap().as_str(),
            ok("10.0.0.1:5600")
        );
        assert_eq!(
            PeerAddr::resolve("127.0.0.1:05600").await.unwrap().as_str(),
            ok("127.0.0.1:5600")
        );
        assert_eq!(
            PeerAddr::resolve("[0:0::1]:80").await.unwrap().as_str(),
            ok("[::1]:80")
        );
    }

    #[tokio::test]
    async fn a_port_with_a_sign_or_no_port_is_not_host_port() {
        for address in [
            "10.0.0.1:+80",
            "10.0.0.1:",
            "not-an-address",
            ":80",
            "10.0.0.1:65536",
        ] {
            assert!(
                matches!(PeerAddr::resolve(address).await, Err(ResolveError::Form(_))),
                "{address}"
            );
        }
    }
}
