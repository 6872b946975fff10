//! Exports, arguments and results: finding the function to call, converting inputs and
//! outputs, and describing traps and captured output.

use wasmtime::{Extern, Func, Instance, Store, Val, ValType};

use super::limits::RunError;

pub(crate) const INTERRUPTED: &str = "propeller: task interrupted";

pub(crate) fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

pub(crate) fn root_cause(error: &wasmtime::Error) -> String {
    let chain: Vec<String> = error.chain().map(|c| c.to_string()).collect();
    chain.join(": ")
}

/// Where a trap happened, one line: ` in <function> at offset 0x…` of the innermost frame.
pub(crate) fn trap_site(error: &wasmtime::Error) -> String {
    let Some(frame) = error
        .downcast_ref::<wasmtime::WasmBacktrace>()
        .and_then(|b| b.frames().first())
    else {
        return String::new();
    };
    let function = match frame.func_name() {
        Some(name) => format!("`{name}`"),
        None => format!("function #{}", frame.func_index()),
    };
    match frame.module_offset() {
        Some(offset) => format!(" in {function} at module offset {offset:#x}"),
        None => format!(" in {function}"),
    }
}

/// Components have layer byte `0x0d` after the magic (`\0asm 0d 00 01 00`); core modules
/// have version 1 (`\0asm 01 00 00 00`).
pub fn is_component(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[0..4] == *b"\0asm" && bytes[4] == 0x0d && bytes[6..8] == [0x01, 0x00]
}

pub(crate) fn resolve_export<T>(
    store: &mut Store<T>,
    instance: &Instance,
    requested: &str,
) -> Result<(String, Func), RunError> {
    let mut candidates = Vec::with_capacity(4);
    if !requested.is_empty() {
        candidates.push(requested);
    }
    candidates.extend(["main", "run", "_start"]);
    for name in candidates {
        if let Some(func) = instance.get_func(&mut *store, name) {
            return Ok((name.to_owned(), func));
        }
    }
    let available: Vec<String> = instance
        .exports(&mut *store)
        .filter_map(|e| {
            let name = e.name().to_owned();
            matches!(e.into_extern(), Extern::Func(_)).then_some(name)
        })
        .collect();
    Err(RunError::NoExport {
        name: requested.to_owned(),
        available: if available.is_empty() {
            "(no functions)".into()
        } else {
            available.join(", ")
        },
    })
}

pub(crate) fn convert_inputs(params: &[ValType], inputs: &[String]) -> Result<Vec<Val>, RunError> {
    if params.len() != inputs.len() {
        return Err(RunError::Inputs(format!(
            "the export takes {} parameter(s), {} input(s) given",
            params.len(),
            inputs.len()
        )));
    }
    params
        .iter()
        .zip(inputs)
        .enumerate()
        .map(|(i, (ty, raw))| {
            let text = raw.trim();
            let bad =
                |what: &str| RunError::Inputs(format!("input #{} {raw:?} is not {what}", i + 1));
            match ty {
                ValType::I32 => text
                    .parse::<i32>()
                    .or_else(|_| text.parse::<u32>().map(|u| u as i32))
                    .map(Val::I32)
                    .map_err(|_| bad("a 32-bit integer")),
                ValType::I64 => text
                    .parse::<i64>()
                    .or_else(|_| text.parse::<u64>().map(|u| u as i64))
                    .map(Val::I64)
                    .map_err(|_| bad("a 64-bit integer")),
                ValType::F32 => text
                    .parse::<f32>()
                    .map(|f| Val::F32(f.to_bits()))
                    .map_err(|_| bad("a number")),
                ValType::F64 => text
                    .parse::<f64>()
                    .map(|f| Val::F64(f.to_bits()))
                    .map_err(|_| bad("a number")),
                other => Err(RunError::Inputs(format!(
                    "parameter #{} has type {other}, which cannot be given as text",
                    i + 1
                ))),
            }
        })
        .collect()
}

pub(crate) fn format_value(value: &Val) -> String {
    match value {
        Val::I32(v) => v.to_string(),
        Val::I64(v) => v.to_string(),
        Val::F32(bits) => f32::from_bits(*bits).to_string(),
        Val::F64(bits) => f64::from_bits(*bits).to_string(),
        _ => String::new(),
    }
}

pub(crate) fn memory_size<T>(store: &mut Store<T>, instance: &Instance) -> usize {
    let memories: Vec<_> = instance
        .exports(&mut *store)
        .filter_map(|e| e.into_memory())
        .collect();
    memories.iter().map(|m| m.data_size(&*store)).sum()
}
