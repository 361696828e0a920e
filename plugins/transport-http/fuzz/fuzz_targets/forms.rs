//! Fuzzes the multipart endpoints' form parsing (`multipart/form-data` through multer, then the
//! fields): the audio endpoints' and the image variations'. The input's first line is the
//! request's content type, the rest its body. Any bytes must give a request or a 4xx
//! `ApiError`, never a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::{
    future::Future,
    pin::pin,
    task::{Context, Poll, Waker},
};
use u_transport_http::{audio, variations};

/// Polls `f` to completion: the body is in memory, so nothing it awaits is ever pending for
/// long (a bound keeps a bug from spinning forever).
fn block_on<T>(f: impl Future<Output = T>) -> T {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("the form parser did not finish");
}

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let content_type = String::from_utf8_lossy(&data[..split]).into_owned();
    let body = bytes::Bytes::copy_from_slice(data.get(split + 1..).unwrap_or(&[]));
    let models = ["whisper".to_string(), "sd".to_string()];
    for translate in [false, true] {
        match block_on(audio::parse(Some(&content_type), body.clone(), &models, translate)) {
            Ok(form) => assert!(!form.request.audio.is_empty()),
            Err(e) => assert!((400..500).contains(&e.status), "{e:?}"),
        }
    }
    match block_on(variations::parse(Some(&content_type), body, &models)) {
        Ok(parsed) => assert!(!parsed.request.init_image.is_empty() && parsed.request.prompt.is_empty()),
        Err(e) => assert!((400..500).contains(&e.status), "{e:?}"),
    }
});
