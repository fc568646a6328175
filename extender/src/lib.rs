//! tessera-extender (see its issue).
