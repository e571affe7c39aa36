//! Deterministic tests of the driver actor (filled below).
