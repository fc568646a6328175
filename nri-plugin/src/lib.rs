//! tessera-nri-plugin (see its issue).
