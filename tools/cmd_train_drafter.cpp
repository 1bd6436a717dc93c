// kakeya train-drafter: make a DFlash drafter for a target that has none. The pipeline (data,
// train, export, eval; resumable; data-parallel under `kakeya launch`) is train/drafter_pipeline.h:
// this file parses the flags into its options and loads the tokenizer and the target for it.
#include "tools/cli_common.h"
#include "train/drafter_pipeline.h"

namespace kakeya::cli {

void register_train_drafter(CLI::App& app) {
  struct Opts {
    train::DrafterPipelineOptions p;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("train-drafter",
                               "Train a DFlash drafter for a target (data from local text, greedy continuations by the "
                               "target), export it in z-lab layout and measure τ on held-out prompts");
  c->add_option("--model", o->p.model, "target HF model directory")->capture_default_str();
  c->add_option("--out", o->p.out, "output directory (data cache, checkpoint, drafter, report)")->required();
  c->add_option("--code", o->p.code, "code sources: *.py files or directories (e.g. the Python stdlib)");
  c->add_option("--prose", o->p.prose, "prose sources: directories with docs/licenses (e.g. site-packages, /usr/share/doc)");
  c->add_option("--heldout-percent", o->p.heldout_percent, "files held out (by content hash)")->capture_default_str();
  c->add_option("--prompt-len", o->p.prompt_len, "prompt tokens (BOS included)")->capture_default_str();
  c->add_option("--gen-len", o->p.gen_len, "greedy continuation tokens per prompt")->capture_default_str();
  c->add_option("--train-prompts", o->p.train_prompts, "max training prompts per domain")->capture_default_str();
  c->add_option("--eval-prompts", o->p.eval_prompts, "held-out prompts per domain for τ")->capture_default_str();
  c->add_option("--gen-batch", o->p.gen_batch, "sequences per batched greedy forward")->capture_default_str();
  c->add_option("--layers", o->p.layers, "drafter layers")->capture_default_str();
  c->add_option("--heads", o->p.heads, "drafter attention heads")->capture_default_str();
  c->add_option("--kv-heads", o->p.kv_heads, "drafter KV heads")->capture_default_str();
  c->add_option("--head-dim", o->p.head_dim, "drafter head dim")->capture_default_str();
  c->add_option("--intermediate", o->p.intermediate, "drafter MLP width")->capture_default_str();
  c->add_option("--block-size", o->p.block_size, "block size B (tokens per verify forward)")->capture_default_str();
  c->add_option("--mask-token", o->p.mask_token, "mask token id (default: the tokenizer's <mask>)");
  c->add_option("--init", o->p.init, "start from this drafter directory instead of random weights");
  c->add_flag("--freeze-context", o->p.train.freeze_context,
              "with --init: keep fc, hidden_norm and every k_proj/v_proj fixed, so the drafter's raw context K/V "
              "(what an f_θ trained on the --init drafter reads) do not change");
  c->add_option("--batch", o->p.train.batch, "sequences per step")->capture_default_str();
  c->add_option("--anchors", o->p.train.anchors, "blocks per sequence")->capture_default_str();
  c->add_option("--gamma", o->p.train.gamma, "loss decay over block positions")->capture_default_str();
  c->add_option("--lr", o->p.train.lr, "peak learning rate")->capture_default_str();
  c->add_option("--warmup", o->p.train.warmup_steps, "warmup steps")->capture_default_str();
  c->add_option("--weight-decay", o->p.train.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  c->add_option("--steps", o->p.train.steps, "optimisation steps (0: as many as --train-seconds allows)")->capture_default_str();
  c->add_option("--train-seconds", o->p.train.train_seconds, "time budget of the optimisation when --steps is 0")
      ->capture_default_str();
  c->add_option("--seed", o->p.train.seed, "seed (data order, anchors, init)")->capture_default_str();
  c->add_option("--deadline", o->p.train.deadline,
                "unix time: checkpoint and exit before it (rerun the command to resume)");
  c->add_option("--checkpoint-seconds", o->p.train.checkpoint_seconds, "checkpoint interval")->capture_default_str();
  c->add_option("--eval-max-new", o->p.eval_max_new, "new tokens per held-out prompt for τ")->capture_default_str();
  c->add_option("--eval-seconds", o->p.eval_seconds, "time the evaluation needs (deferred if the deadline is closer)")
      ->capture_default_str();
  c->add_option("--heldout-batches", o->p.heldout_batches, "teacher-forced held-out batches per domain")->capture_default_str();
  c->add_flag("--eval-only", o->p.eval_only, "skip data and training: evaluate --drafter (default OUT/drafter)");
  c->add_option("--drafter", o->p.drafter, "drafter to evaluate with --eval-only");
  c->add_option("--commit", o->p.commit, "source commit, recorded in the manifest")->capture_default_str();
  o->df.add(c);

  c->callback([o] {
    train::DrafterPipelineOptions p = o->p;
    p.command = command_line();
    p.device = o->df.device;
    p.torch_device = o->df.torch_device();
    train::make_drafter(p, {[&] { return load_tokenizer(p.model); },
                            [&](int64_t positions) { return load_model(p.model, o->df, positions); }});
  });
}

}  // namespace kakeya::cli
