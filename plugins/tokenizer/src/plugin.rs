//! The ABI side: [`u_sdk::TokenizerFactory`], reading files only through the host.

use crate::Tok;
use abi_stable::std_types::{RResult, RStr};
use std::{fs::File, io::Read, os::fd::FromRawFd};
use u_sdk::{
    ErrorKind, HostBox, TokenizerBox, TokenizerFactory, TokenizerFactoryBox, UError, WeightSetBox,
};

/// Builds tokenizers from GGUF weight sets and `tokenizer.json` files.
#[derive(Clone)]
pub struct Factory {
    host: HostBox,
}

impl Factory {
    /// A factory that opens files through `host`.
    pub fn new(host: HostBox) -> Self {
        Self { host }
    }

    /// This factory as an ABI object.
    pub fn into_box(self) -> TokenizerFactoryBox {
        TokenizerFactoryBox::new(self)
    }

    fn read(&self, path: &str) -> Result<String, UError> {
        let fd = self.host.open_read(path.into()).into_result()?;
        if fd < 0 {
            return Err(UError::new(
                ErrorKind::Internal,
                format!("host returned an invalid file descriptor {fd} for {path}"),
            ));
        }
        // SAFETY: the host hands over an open descriptor that this plugin now owns.
        let mut file = unsafe { File::from_raw_fd(fd) };
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| UError::io(format!("read {path}"), e))?;
        Ok(text)
    }
}

impl TokenizerFactory for Factory {
    fn build_from_weights(&self, weights: WeightSetBox) -> RResult<TokenizerBox, UError> {
        Tok::from_meta(&weights).map(Tok::into_box).into()
    }

    fn build_from_file(&self, path: RStr<'_>) -> RResult<TokenizerBox, UError> {
        (|| {
            let path = path.as_str();
            let json = self.read(path)?;
            // The config beside it is optional: absent or not granted means none.
            let config_path = std::path::Path::new(path).with_file_name("tokenizer_config.json");
            let config = config_path.to_str().and_then(|p| self.read(p).ok());
            let tok = Tok::from_json(&json, config.as_deref())
                .map_err(|e| UError::new(e.kind, format!("{path}: {}", e.message)))?;
            Ok(tok.into_box())
        })()
        .into()
    }
}
