//! The server's user accounts (`--users FILE`): one line per user, `name:verifier [role]`, where the
//! verifier is Postgres's SCRAM-SHA-256 format, `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`
//! (base64), so one file serves both the Flight SQL handshake and SCRAM on the Postgres wire, and
//! the role is `reader`, `writer` or `admin` ([`sluice_engine::access`]; a line without one is a
//! reader). Blank lines and lines starting with `#` are ignored. `sluice hash-password` prints a
//! verifier.
//!
//! Invariants: no password is stored or logged; a check derives the StoredKey from the offered
//! password and compares it in constant time; an unknown user costs the same derivation as a known one.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use sluice_engine::access::Role;
use sluice_engine::{Result, SluiceError};
use subtle::ConstantTimeEq;

/// PBKDF2 rounds of new verifiers (Postgres's default).
pub const DEFAULT_ITERATIONS: u32 = 4096;

/// One user's SCRAM-SHA-256 verifier.
#[derive(Clone, PartialEq, Eq)]
pub struct Verifier {
    iterations: u32,
    salt: Vec<u8>,
    stored_key: [u8; 32],
    server_key: [u8; 32],
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("iterations", &self.iterations)
            .finish_non_exhaustive()
    }
}

pub(crate) fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => return [0; 32],
    };
    mac.update(message);
    mac.finalize().into_bytes().into()
}

fn salted_password(password: &str, salt: &[u8], iterations: u32) -> [u8; 32] {
    let mut salted = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations, &mut salted);
    salted
}

fn stored_key(salted: &[u8; 32]) -> [u8; 32] {
    Sha256::digest(hmac(salted, b"Client Key")).into()
}

impl Verifier {
    /// The verifier of `password` with `salt` and `iterations`.
    pub fn new(password: &str, salt: &[u8], iterations: u32) -> Self {
        let salted = salted_password(password, salt, iterations);
        Self {
            iterations,
            salt: salt.to_vec(),
            stored_key: stored_key(&salted),
            server_key: hmac(&salted, b"Server Key"),
        }
    }

    /// A verifier with a fresh random salt.
    pub fn generate(password: &str) -> Result<Self> {
        let mut salt = [0u8; 16];
        getrandom::fill(&mut salt)
            .map_err(|e| SluiceError::invalid(format!("cannot make a salt: {e}")))?;
        Ok(Self::new(password, &salt, DEFAULT_ITERATIONS))
    }

    /// Whether `password` is this verifier's.
    pub fn check(&self, password: &str) -> bool {
        let salted = salted_password(password, &self.salt, self.iterations);
        stored_key(&salted).ct_eq(&self.stored_key).into()
    }

    /// The PBKDF2 rounds.
    pub(crate) fn iterations(&self) -> u32 {
        self.iterations
    }

    /// The salt.
    pub(crate) fn salt(&self) -> &[u8] {
        &self.salt
    }

    /// SHA-256(HMAC(SaltedPassword, "Client Key")).
    pub(crate) fn stored_key(&self) -> &[u8; 32] {
        &self.stored_key
    }

    /// HMAC(SaltedPassword, "Server Key").
    pub(crate) fn server_key(&self) -> &[u8; 32] {
        &self.server_key
    }

    /// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`.
    pub fn to_text(&self) -> String {
        format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            STANDARD.encode(&self.salt),
            STANDARD.encode(self.stored_key),
            STANDARD.encode(self.server_key)
        )
    }

    /// Parses [`Self::to_text`]'s format.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let bad =
            || "expected SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>".to_string();
        let rest = text.trim().strip_prefix("SCRAM-SHA-256$").ok_or_else(bad)?;
        let (head, keys) = rest.split_once('$').ok_or_else(bad)?;
        let (iterations, salt) = head.split_once(':').ok_or_else(bad)?;
        let (stored, server) = keys.split_once(':').ok_or_else(bad)?;
        let iterations: u32 = iterations.parse().map_err(|_| bad())?;
        if iterations == 0 {
            return Err("the iteration count must be at least 1".into());
        }
        let decode = |part: &str| {
            STANDARD
                .decode(part)
                .map_err(|e| format!("bad base64: {e}"))
        };
        let key = |part: &str| -> std::result::Result<[u8; 32], String> {
            decode(part)?
                .try_into()
                .map_err(|_| "a key must be 32 bytes".to_string())
        };
        Ok(Self {
            iterations,
            salt: decode(salt)?,
            stored_key: key(stored)?,
            server_key: key(server)?,
        })
    }
}

/// One account: its verifier and role (`None`: none given, so a reader).
#[derive(Debug, Clone)]
struct Account {
    verifier: Verifier,
    role: Option<Role>,
}

/// The accounts of a users file.
#[derive(Debug, Clone, Default)]
pub struct Users {
    by_name: HashMap<String, Account>,
    /// Checked for unknown users, so they take as long as known ones.
    decoy: Option<Verifier>,
    /// Makes each unknown user's SCRAM salt (random per process, so salts cannot be compared
    /// across servers or runs).
    decoy_key: [u8; 32],
}

impl Users {
    /// Reads `path`; a malformed line is an error naming the file and line.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| SluiceError::io(path, e))?;
        Self::parse(&text).map_err(|message| {
            SluiceError::invalid(format!("users file {}: {message}", path.display()))
        })
    }

    /// Parses the text of a users file.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut by_name = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let number = index + 1;
            let (name, rest) = line
                .split_once(':')
                .ok_or_else(|| format!("line {number}: expected name:verifier [role]"))?;
            let mut words = rest.split_whitespace();
            let verifier = Verifier::parse(words.next().unwrap_or_default())
                .map_err(|message| format!("line {number}: {message}"))?;
            let role = match words.next() {
                None => None,
                Some(word) => Some(Role::parse(word).ok_or_else(|| {
                    format!("line {number}: '{word}' is not a role (reader, writer or admin)")
                })?),
            };
            if let Some(extra) = words.next() {
                return Err(format!(
                    "line {number}: unexpected '{extra}' after the role (expected name:verifier [role])"
                ));
            }
            let account = Account { verifier, role };
            if by_name.insert(name.trim().to_string(), account).is_some() {
                return Err(format!(
                    "line {number}: user '{}' is given twice",
                    name.trim()
                ));
            }
        }
        if by_name.is_empty() {
            return Err("no users".into());
        }
        // As slow as the slowest real account, whatever the name.
        let iterations = by_name
            .values()
            .map(|account| account.verifier.iterations)
            .max()
            .unwrap_or(DEFAULT_ITERATIONS);
        let decoy = Some(Verifier::new("", b"sluice-decoy-salt", iterations));
        let mut decoy_key = [0u8; 32];
        getrandom::fill(&mut decoy_key).map_err(|e| format!("cannot make a decoy key: {e}"))?;
        Ok(Self {
            by_name,
            decoy,
            decoy_key,
        })
    }

    /// Whether `user` exists and `password` is theirs.
    pub fn check(&self, user: &str, password: &str) -> bool {
        match self.by_name.get(user) {
            Some(account) => account.verifier.check(password),
            None => {
                if let Some(decoy) = &self.decoy {
                    let _ = decoy.check(password);
                }
                false
            }
        }
    }

    /// The verifier a SCRAM exchange for `user` runs against, and whether the user exists: an
    /// unknown user gets a decoy with a salt of its own (the same on every try, as a real account's
    /// is) and the real accounts' iteration count, so the exchange looks the same until it fails.
    pub fn verifier(&self, user: &str) -> Option<(Verifier, bool)> {
        if let Some(account) = self.by_name.get(user) {
            return Some((account.verifier.clone(), true));
        }
        let decoy = self.decoy.as_ref()?;
        let salt = hmac(&self.decoy_key, user.as_bytes());
        Some((
            Verifier {
                iterations: decoy.iterations,
                salt: salt[..16].to_vec(),
                stored_key: hmac(&salt, b"stored"),
                server_key: hmac(&salt, b"server"),
            },
            false,
        ))
    }

    /// `user`'s role (a reader when the file gives none); `None` for an unknown user.
    pub fn role(&self, user: &str) -> Option<Role> {
        self.by_name
            .get(user)
            .map(|account| account.role.unwrap_or(Role::Reader))
    }

    /// The users whose line names no role (readers by default), sorted.
    pub fn without_role(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .by_name
            .iter()
            .filter(|(_, account)| account.role.is_none())
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names
    }

    /// How many accounts there are.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_verifier_accepts_its_password_only_and_round_trips() {
        let verifier = Verifier::new("s3cret", b"0123456789abcdef", 4096);
        assert!(verifier.check("s3cret"));
        assert!(!verifier.check("s3cret "));
        assert!(!verifier.check(""));
        let text = verifier.to_text();
        assert!(
            text.starts_with("SCRAM-SHA-256$4096:MDEyMzQ1Njc4OWFiY2RlZg==$"),
            "{text}"
        );
        assert_eq!(Verifier::parse(&text).unwrap(), verifier);
    }

    #[test]
    fn the_keys_follow_rfc_7677() {
        // RFC 7677's example: password "pencil", salt W22ZaJ0SNY7soEsUEjb6gQ==, 4096 iterations; its
        // ServerSignature v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4= is HMAC(ServerKey, AuthMessage).
        let salt = STANDARD.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let verifier = Verifier::new("pencil", &salt, 4096);
        let auth_message = "n=user,r=rOprNGfwEbeRWgbNEkqO,\
                            r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
                            s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,\
                            c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
        let signature = hmac(&verifier.server_key, auth_message.as_bytes());
        assert_eq!(
            STANDARD.encode(signature),
            "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn a_users_file_checks_names_and_passwords_and_names_bad_lines() {
        let ann = Verifier::new("a", b"salt-one", 16).to_text();
        let bob = Verifier::new("b", b"salt-two", 16).to_text();
        let users = Users::parse(&format!("# accounts\nann:{ann}\n\nbob:{bob}\n")).unwrap();
        assert_eq!(users.len(), 2);
        assert!(users.check("ann", "a"));
        assert!(!users.check("ann", "b"));
        assert!(users.check("bob", "b"));
        assert!(!users.check("carol", "a"));
        assert_eq!(
            Users::parse(&format!("ann:{ann}\nann:{bob}")).unwrap_err(),
            "line 2: user 'ann' is given twice"
        );
        assert_eq!(
            Users::parse("ann:plaintext").unwrap_err(),
            "line 1: expected SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>"
        );
        assert_eq!(Users::parse("# nobody\n").unwrap_err(), "no users");
        // Roles follow the verifier after a space; a line without one is a reader.
        let with_roles = Users::parse(&format!(
            "ann:{ann} admin\nbob:{bob}\t writer\ncarol:{ann}\ndave:{bob} reader\n"
        ))
        .unwrap();
        assert_eq!(with_roles.role("ann"), Some(Role::Admin));
        assert_eq!(with_roles.role("bob"), Some(Role::Writer));
        assert_eq!(with_roles.role("carol"), Some(Role::Reader));
        assert_eq!(with_roles.role("dave"), Some(Role::Reader));
        assert_eq!(with_roles.role("eve"), None);
        assert_eq!(with_roles.without_role(), vec!["carol"]);
        assert!(with_roles.check("bob", "b"));
        assert_eq!(
            Users::parse(&format!("ann:{ann} root")).unwrap_err(),
            "line 1: 'root' is not a role (reader, writer or admin)"
        );
        assert_eq!(
            Users::parse(&format!("ann:{ann} admin extra")).unwrap_err(),
            "line 1: unexpected 'extra' after the role (expected name:verifier [role])"
        );
        // Unknown users get salts of their own, stable across tries, and the accounts' rounds.
        let (carol, known) = users.verifier("carol").unwrap();
        let (dave, _) = users.verifier("dave").unwrap();
        assert!(!known);
        assert_ne!(carol.salt(), dave.salt());
        assert_eq!(users.verifier("carol").unwrap().0, carol);
        assert_eq!(carol.iterations(), 16);
        assert!(users.verifier("ann").unwrap().1);
    }
}
