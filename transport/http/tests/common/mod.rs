pub(crate) mod server;
