//! The JSON bodies of the routes, with Dynamo 1.6.1's field names, defaults and shapes.

pub mod dump;
mod flat;
pub(crate) mod msgpack;
pub mod prompt;
pub mod select;
pub mod source;
pub(crate) mod tokens;
pub mod worker;
