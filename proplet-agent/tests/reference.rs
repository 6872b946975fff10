//! The book's `proplet` flag reference (`docs/src/reference/proplet.md`) is what the flags
//! generate. `UPDATE_REFERENCE=1 cargo test -p proplet-agent --test reference` rewrites it.

use clap::CommandFactory;
use proplet_agent::config::Flags;

#[test]
fn the_books_flag_reference_matches_the_flags() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference/proplet.md");
    let options = clap_markdown::MarkdownOptions::new()
        .title("`proplet` command line".to_owned())
        .show_footer(false);
    let mut generated = clap_markdown::help_markdown_custom::<Flags>(&options);
    generated.push_str(&environment_table());
    if std::env::var_os("UPDATE_REFERENCE").is_some() {
        std::fs::write(&path, &generated).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        kept == generated,
        "{} is not what the flags generate; rewrite it with `UPDATE_REFERENCE=1 cargo test -p proplet-agent --test reference`",
        path.display()
    );
}

/// The environment variable of each flag (clap-markdown leaves them out; on a device they
/// are how the service is usually configured).
fn environment_table() -> String {
    let mut table = String::from(
        "\n## Environment\n\nEach flag can be set through its environment variable, or in the \
         TOML file given by `--config` (the flag's name with `_` for `-`). Flags win over the \
         environment, which wins over the file.\n\n| Variable | Flag |\n|---|---|\n",
    );
    for arg in Flags::command().get_arguments() {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        table.push_str(&format!("| `{}` | `--{long}` |\n", env.to_string_lossy()));
    }
    table
}
