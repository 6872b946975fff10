//! The book's `proplet` flag reference (`docs/src/reference/proplet.md`) is what the flags
//! generate. `UPDATE_REFERENCE=1 cargo test -p proplet-agent --test reference` rewrites it.

use proplet_agent::config::Flags;

#[test]
fn the_books_flag_reference_matches_the_flags() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference/proplet.md");
    let options = clap_markdown::MarkdownOptions::new()
        .title("`proplet` command line".to_owned())
        .show_footer(false);
    let generated = clap_markdown::help_markdown_custom::<Flags>(&options);
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
