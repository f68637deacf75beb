//! Rate limits for what local clients send: the token bucket lives in
//! [`crate::bounds`] (the sessions layer uses it too).

pub use crate::bounds::TokenBucket;
