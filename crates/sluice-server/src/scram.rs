//! The server side of a SCRAM-SHA-256 exchange (RFC 5802, RFC 7677), as pure code over a
//! [`Verifier`]: messages in, messages out, no sockets. The Postgres wire's login runs it.
//!
//! ```text
//!  client-first  "n,,n=<user>,r=<client nonce>"          ──► ServerFirst::answer
//!  server-first  "r=<client+server nonce>,s=<salt>,i=<n>" ◄──
//!  client-final  "c=biws,r=<nonce>,p=<proof>"             ──► ServerFirst::finish
//!  server-final  "v=<server signature>"                   ◄── (or an error: wrong password)
//! ```
//!
//! Invariants: the proof is checked against the StoredKey in constant time (no password or salted
//! password is ever held); an unknown user runs the same exchange against a decoy verifier and
//! fails only at the end; channel binding (SCRAM-SHA-256-PLUS) is not offered, even over TLS
//! (it would need the TLS session's certificate hash here), so a client that asks for it (`p=`) is
//! refused.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::users::{Verifier, hmac};

/// Why an exchange failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScramError {
    /// A message does not follow RFC 5802.
    Malformed(String),
    /// The proof does not match: wrong password or unknown user.
    Refused,
}

/// An exchange after the server-first message: waiting for the client's proof.
#[derive(Debug)]
pub struct ServerFirst {
    /// The server-first message to send.
    pub message: String,
    client_first_bare: String,
    gs2_header: String,
    nonce: String,
    stored_key: [u8; 32],
    server_key: [u8; 32],
    known: bool,
}

fn malformed(what: &str) -> ScramError {
    ScramError::Malformed(format!("malformed SCRAM {what}"))
}

/// The value of attribute `name` (`name=value`) in `part`.
fn attribute<'a>(part: Option<&'a str>, name: char, what: &str) -> Result<&'a str, ScramError> {
    part.and_then(|p| p.strip_prefix(name))
        .and_then(|p| p.strip_prefix('='))
        .ok_or_else(|| malformed(what))
}

impl ServerFirst {
    /// Answers `client_first` for the account `verifier` (`known`: the user exists), adding
    /// `server_nonce` (random, printable, no commas) to the client's nonce.
    pub fn answer(
        client_first: &str,
        verifier: &Verifier,
        known: bool,
        server_nonce: &str,
    ) -> Result<Self, ScramError> {
        let mut parts = client_first.splitn(3, ',');
        let binding = parts
            .next()
            .ok_or_else(|| malformed("client-first message"))?;
        let authzid = parts
            .next()
            .ok_or_else(|| malformed("client-first message"))?;
        let bare = parts
            .next()
            .ok_or_else(|| malformed("client-first message"))?;
        match binding {
            "n" | "y" => {}
            _ if binding.starts_with("p=") => {
                return Err(ScramError::Malformed(
                    "SCRAM channel binding is not offered on this connection".into(),
                ));
            }
            _ => return Err(malformed("client-first message")),
        }
        let mut attributes = bare.split(',');
        attribute(attributes.next(), 'n', "client-first message (user)")?;
        let client_nonce = attribute(attributes.next(), 'r', "client-first message (nonce)")?;
        if client_nonce.is_empty() {
            return Err(malformed("client-first message (empty nonce)"));
        }
        let nonce = format!("{client_nonce}{server_nonce}");
        let message = format!(
            "r={nonce},s={},i={}",
            STANDARD.encode(verifier.salt()),
            verifier.iterations()
        );
        Ok(Self {
            message,
            client_first_bare: bare.to_string(),
            gs2_header: format!("{binding},{authzid},"),
            nonce,
            stored_key: *verifier.stored_key(),
            server_key: *verifier.server_key(),
            known,
        })
    }

    /// Checks the client's proof in `client_final`; on success, the server-final message.
    pub fn finish(self, client_final: &str) -> Result<String, ScramError> {
        let (without_proof, proof) = client_final
            .rsplit_once(",p=")
            .ok_or_else(|| malformed("client-final message (proof)"))?;
        let mut attributes = without_proof.split(',');
        let binding = attribute(attributes.next(), 'c', "client-final message (binding)")?;
        let nonce = attribute(attributes.next(), 'r', "client-final message (nonce)")?;
        if STANDARD.decode(binding).ok().as_deref() != Some(self.gs2_header.as_bytes()) {
            return Err(malformed("client-final message (binding differs)"));
        }
        if nonce != self.nonce {
            return Err(malformed("client-final message (nonce differs)"));
        }
        let proof: [u8; 32] = STANDARD
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| malformed("client-final message (proof)"))?;
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.message
        );
        let signature = hmac(&self.stored_key, auth_message.as_bytes());
        let client_key: Vec<u8> = proof.iter().zip(signature).map(|(p, s)| p ^ s).collect();
        let derived: [u8; 32] = Sha256::digest(&client_key).into();
        let matches: bool = derived.ct_eq(&self.stored_key).into();
        if !(matches && self.known) {
            return Err(ScramError::Refused);
        }
        let server_signature = hmac(&self.server_key, auth_message.as_bytes());
        Ok(format!("v={}", STANDARD.encode(server_signature)))
    }
}

/// A fresh server nonce: 18 random bytes, base64 (printable, no commas).
pub fn server_nonce() -> Result<String, ScramError> {
    let mut bytes = [0u8; 18];
    getrandom::fill(&mut bytes)
        .map_err(|e| ScramError::Malformed(format!("cannot make a nonce: {e}")))?;
    Ok(STANDARD.encode(bytes))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    const CLIENT_FIRST: &str = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
    const SERVER_NONCE: &str = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
    const CLIENT_FINAL: &str = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
                                p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";

    fn pencil() -> Verifier {
        let salt = STANDARD.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        Verifier::new("pencil", &salt, 4096)
    }

    #[test]
    fn the_exchange_of_rfc_7677_succeeds_with_its_messages() {
        let first = ServerFirst::answer(CLIENT_FIRST, &pencil(), true, SERVER_NONCE).unwrap();
        assert_eq!(
            first.message,
            "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
        );
        assert_eq!(
            first.finish(CLIENT_FINAL).unwrap(),
            "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn a_wrong_password_or_an_unknown_user_is_refused() {
        let other = Verifier::new(
            "not pencil",
            &STANDARD.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap(),
            4096,
        );
        let first = ServerFirst::answer(CLIENT_FIRST, &other, true, SERVER_NONCE).unwrap();
        assert_eq!(first.finish(CLIENT_FINAL), Err(ScramError::Refused));
        // Right proof, but the account is the decoy of an unknown user.
        let first = ServerFirst::answer(CLIENT_FIRST, &pencil(), false, SERVER_NONCE).unwrap();
        assert_eq!(first.finish(CLIENT_FINAL), Err(ScramError::Refused));
    }

    #[test]
    fn tampered_or_malformed_messages_are_named() {
        let first = || ServerFirst::answer(CLIENT_FIRST, &pencil(), true, SERVER_NONCE).unwrap();
        let other_nonce = CLIENT_FINAL.replace("k0,", "k1,");
        assert_eq!(
            first().finish(&other_nonce),
            Err(ScramError::Malformed(
                "malformed SCRAM client-final message (nonce differs)".into()
            ))
        );
        assert_eq!(
            first().finish("c=biws"),
            Err(ScramError::Malformed(
                "malformed SCRAM client-final message (proof)".into()
            ))
        );
        assert_eq!(
            ServerFirst::answer("p=tls-server-end-point,,n=,r=x", &pencil(), true, "s")
                .unwrap_err(),
            ScramError::Malformed("SCRAM channel binding is not offered on this connection".into())
        );
        assert_eq!(
            ServerFirst::answer("hello", &pencil(), true, "s").unwrap_err(),
            ScramError::Malformed("malformed SCRAM client-first message".into())
        );
    }
}
