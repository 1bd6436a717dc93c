// kakeya: one binary, a subcommand per job. Library code throws kakeya::Error
// with context; this is the one place that catches and reports it.
#include <CLI/CLI.hpp>

#include <iostream>

#include "core/error.h"
#include "tools/cli_common.h"

int main(int argc, char** argv) {
  CLI::App app{"Kakeya: memory-bounded LLM inference (capture, train, calibrate, decode)"};
  app.require_subcommand(1);
  kakeya::cli::register_generate(app);
  kakeya::cli::register_score(app);
  kakeya::cli::register_bench(app);
  kakeya::cli::register_bench_spec(*app.get_subcommand("bench"));
  kakeya::cli::register_calibrate(app);
  kakeya::cli::register_codec_eval(app);
  kakeya::cli::set_command_line(argc, argv);
  kakeya::cli::register_spec(app);
  kakeya::cli::register_train_drafter(app);
  kakeya::cli::register_draft_vocab(app);
  kakeya::cli::register_decode(app);
  kakeya::cli::register_niah(app);
  kakeya::cli::register_sweep_alpha(app);
  kakeya::cli::register_eval_long(app);
  kakeya::cli::register_ftheta_layers(app);
  kakeya::cli::register_ftheta_exact(app);
  kakeya::cli::register_launch(app);
#ifdef KAKEYA_HAVE_SERVE
  kakeya::cli::register_serve(app);
#endif
#ifdef KAKEYA_HAVE_CAPTURE
  kakeya::cli::register_capture(app);
  kakeya::cli::register_train_ftheta(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kakeya::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "error (torch): " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
