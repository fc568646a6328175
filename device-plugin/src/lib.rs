//! tessera-device-plugin (see its issue).
