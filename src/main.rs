use anyhow::Result;
use clap::Parser;
use smolchat::cli::{self, Cli, Command};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    // The sandboxed document reader runs before anything else (no logger, no threads): the
    // server starts it under tight limits, and it answers on stdout.
    let mut argv = std::env::args();
    if argv.nth(1).as_deref() == Some("extract") {
        if let Some(Command::Extract(a)) = Cli::parse().command {
            std::process::exit(smolchat_service::documents::child_main(
                smolchat_service::files::PdfCaps {
                    max_text_bytes: a.max_text_bytes,
                    max_inflated_bytes: a.max_inflated_bytes,
                },
            ));
        }
    }
    let spec = std::env::var("SMOLCHAT_LOG").unwrap_or_else(|_| "warn,smolchat=info".into());
    let mut filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,smolchat=info"));
    // actix-http logs every malformed request (bad request line, invalid header, a URI it
    // cannot parse) at ERROR, so any client could flood the log; those are client faults about
    // one connection. Silenced unless the operator names `actix_http` in SMOLCHAT_LOG.
    if !spec.contains("actix_http") {
        filter = filter.add_directive(
            "actix_http::h1=off"
                .parse()
                .map_err(|e| anyhow::anyhow!("log filter: {e}"))?,
        );
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log line that cannot be written (stderr sent to a file on a full disk) is lost, not
        // reported with `eprintln!`, which panics when stderr fails too and took the request
        // being served down with it.
        .log_internal_errors(false)
        .init();
    let args = Cli::parse();
    // The commands that compute size the thread pool once their configuration is read.
    let globals = args.globals;
    // `serve` is the default subcommand: parse again with it appended (global flags stay valid).
    let command = match args.command {
        Some(c) => c,
        None => match Cli::parse_from(std::env::args().chain(["serve".to_string()])).command {
            Some(c) => c,
            None => anyhow::bail!("no subcommand"),
        },
    };
    match &command {
        Command::Serve(a) => cli::serve::run(a, &globals),
        Command::Generate(a) => cli::generate::run(a, &globals),
        Command::Chat(a) => cli::chat::run(a, &globals),
        Command::Tokenize(a) => cli::tokenize::run(a, &globals),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Logits(a) => cli::logits::run(a, &globals),
        Command::Bench(a) => cli::bench::run(a, &globals),
        Command::Backup(a) => cli::backup::run(a),
        Command::Restore(a) => cli::backup::restore(a),
        Command::User(a) => cli::user::run(a),
        Command::Invite(a) => cli::user::invite(a),
        Command::Model(a) => cli::model::run(a),
        Command::Knowledge(a) => cli::knowledge::run(a),
        Command::Extract(a) => std::process::exit(smolchat_service::documents::child_main(
            smolchat_service::files::PdfCaps {
                max_text_bytes: a.max_text_bytes,
                max_inflated_bytes: a.max_inflated_bytes,
            },
        )),
    }
}
