//! tessera-cdi-generator (see its issue).
