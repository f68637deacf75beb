//! The rate limits local clients meet live in [`crate::rate`] (the
//! sessions layer uses them too); re-exported for the routes.

pub use crate::rate::{Exceeded, Limited, OpenLimiter, Rate, TokenBucket};
