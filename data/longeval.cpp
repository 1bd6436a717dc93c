#include "data/longeval.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "data/prompt_util.h"

namespace kakeya::data {

namespace {

// Sample numbers stay below 2^40; train adds 2^41 (data/niah.h's train split adds
// 2^40), so the three ranges never meet.
constexpr uint64_t kSeedLimit = uint64_t(1) << 40;
constexpr uint64_t kTrainSeedOffset = uint64_t(1) << 41;

enum class Family { Niah, Vt, Cwe, Fwe };
enum class Value { Digits, Words, Uuid };

struct Task {
  const char* name;
  Family family;
  Value value;         // niah_*: kind of the needles' values
  int keys;            // niah_*: distinct keys among the needles
  int values_per_key;  // niah_*: needles per key
  int queries;         // niah_*: keys asked for
  // Generation budget: RULER's tokens_to_generate (niah 128 cut to 32, vt 30, cwe 120,
  // fwe 50), raised to at least twice the answers' tokens with Gemma's tokenizer (digit
  // by digit): 4 numbers of 7 digits ~35 tokens, a UUID ~37, 5 variable names ~24.
  int64_t max_new_tokens;
};

const Task kTasks[] = {
    {"niah_single_digits", Family::Niah, Value::Digits, 1, 1, 1, 32},
    {"niah_single_words", Family::Niah, Value::Words, 1, 1, 1, 32},
    {"niah_single_uuid", Family::Niah, Value::Uuid, 1, 1, 1, 80},
    {"niah_multikey", Family::Niah, Value::Digits, 4, 1, 1, 32},
    {"niah_multivalue", Family::Niah, Value::Digits, 1, 4, 1, 80},
    {"niah_multiquery", Family::Niah, Value::Digits, 4, 1, 4, 80},
    {"vt", Family::Vt, Value::Digits, 0, 0, 0, 48},
    {"cwe", Family::Cwe, Value::Digits, 0, 0, 0, 120},
    {"fwe", Family::Fwe, Value::Digits, 0, 0, 0, 50},
};

// One split's wording. Placeholders: {type}/{types} (value kind, singular/plural),
// {key}, {value}, {query} (the asked keys), {x}/{y} (variable names), {n} (a count
// or an item number).
struct Templates {
  const char* value_kind[3][2];  // Digits, Words, Uuid: {singular, plural}
  const char* query_last_sep;    // before the last of several keys
  const char* niah_instruction_one;
  const char* niah_instruction_many;
  const char* niah_needle;
  const char* niah_question_one;
  const char* niah_question_many;
  const char* niah_answer_one;
  const char* niah_answer_many;
  const char* vt_instruction;
  const char* vt_noise;  // one filler line, repeated
  const char* vt_assign_value;
  const char* vt_assign_var;
  const char* vt_question;
  const char* vt_answer;
  int vt_name_letters;  // variable names (the in-context example's are shorter)
  int vt_example_name_letters;
  const char* cwe_instruction;
  const char* cwe_item;  // the number before each word
  const char* cwe_question;
  const char* cwe_answer;
  const char* fwe_instruction;
  const char* fwe_noise;  // the most frequent "word", to be ignored
  const char* fwe_question;
  const char* fwe_answer;
  int fwe_word_letters;
};

// Eval: RULER's templates (scripts/data/synthetic/constants.py, niah.py,
// variable_tracking.py), singular forms as niah.py derives them for one answer.
const Templates kEval = {
    {{"number", "numbers"}, {"word", "words"}, {"uuid", "uuids"}},
    ", and ",
    "A special magic {type} is hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the {type} afterwards.\n",
    "Some special magic {types} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {types} afterwards.\n",
    "One of the special magic {types} for {key} is: {value}.\n",
    "What is the special magic {type} for {query} mentioned in the provided text?",
    "What are all the special magic {types} for {query} mentioned in the provided text?",
    "The special magic {type} for {query} mentioned in the provided text is",
    "The special magic {types} for {query} mentioned in the provided text are",
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n",
    "VAR {x} = {value}\n",
    "VAR {y} = VAR {x}\n",
    "Question: Find all variables that are assigned the value {value} in the text above.",
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned the "
    "value {value}, they are:",
    5,
    3,
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n",
    "{n}.",
    "Question: What are the 10 most common words in the above list?",
    "Answer: The top 10 words that appear most often in the list are:",
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words.",
    "...",
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
    "appeared words in the above coded text?",
    "Answer: According to the coded text above, the three most frequently appeared words are:",
    6,
};

// Train: the same tasks in other words (no phrase of kEval).
const Templates kTrain = {
    {{"code", "codes"}, {"passphrase", "passphrases"}, {"identifier", "identifiers"}},
    " and ",
    "The passage below contains one secret {type}. Keep it in mind, since you will be asked for it at the end.\n",
    "The passage below contains several secret {types}. Keep them in mind, since you will be asked for them at "
    "the end.\n",
    "Remember: the secret {type} of {key} equals {value}.\n",
    "Query: Which secret {type} belongs to {query}?",
    "Query: Name every secret {type} that belongs to {query}.",
    "Reply: The secret {type} of {query} equals",
    "Reply: The secret {types} of {query} are",
    "Some register assignments are scattered through the filler sentences below. Follow each assignment step by "
    "step.\n\n",
    "A cat sat on the mat. Rain falls in spring. Bread is baked at dawn. Off we sail. Round and round it goes.\n",
    "REG {x} := {value}\n",
    "REG {y} := REG {x}\n",
    "Query: Which registers end up holding {value} in the passage above?",
    "Reply: Following the register assignments in the passage above, {n} registers hold {value}, namely:",
    6,
    4,
    "What follows is an enumerated sequence of terms. A few terms recur far more frequently than the rest; keep "
    "count of them.\n",
    "[{n}]",
    "Query: Which 10 terms recur most frequently in the sequence above?",
    "Reply: The 10 most frequent terms in the sequence are:",
    "What follows is a stream of invented tokens. Count how often each invented token occurs and find the three "
    "that occur most.",
    "~~",
    "Query: Give no reasoning and skip every '~~'. Which three invented tokens occur most in the stream above?",
    "Reply: Counting the stream above, the three invented tokens that occur most are:",
    7,
};

const Templates& templates(LongSplit s) { return s == LongSplit::Eval ? kEval : kTrain; }

// Keys ("<word>-<word>"), word values and cwe words: the eval split takes the
// even-indexed words, train the odd ones. Nouns, verbs and adjectives of at least 4
// letters, none of niah.cpp's key words, none a substring of another entry or of a
// template (the scorer matches substrings).
// clang-format off
const char* const kWords[] = {
    "apple", "autumn", "bakery", "balcony", "bamboo", "banana", "barrel", "basket", "battery", "bicycle", "blanket",
    "blossom", "bottle", "branch", "breeze", "brick", "broom", "bucket", "buffalo", "button", "cabbage", "cabin",
    "cactus", "camera", "camel", "canvas", "carpet", "carrot", "cattle", "cellar", "cement", "cereal", "chalk",
    "cherry", "chimney", "circus", "cliff", "clock", "closet", "coconut", "coffee", "collar", "comet", "copper",
    "cotton", "cougar", "cradle", "crayon", "cricket", "crystal", "cushion", "dagger", "daisy", "diamond", "dinner",
    "donkey", "drawer", "eagle", "elbow", "elephant", "envelope", "fabric", "fence", "ferry", "fiddle", "finger",
    "flame", "flute", "fountain", "fridge", "funnel", "garlic", "giraffe", "ginger", "glove", "goblet", "grape",
    "gravel", "guitar", "hamster", "harvest", "hazel", "helmet", "honey", "horizon", "hornet", "jacket", "jaguar",
    "jewel", "kitchen", "kitten", "koala", "ladle", "lemon", "leopard", "lettuce", "library", "lizard", "lobster",
    "locket", "lumber", "mango", "maple", "marsh", "melon", "mitten", "monkey", "mosaic", "muffin", "mushroom",
    "napkin", "nickel", "notebook", "nutmeg", "onion", "orange", "oyster", "paddle", "palace", "pancake", "panther",
    "parrot", "peach", "peanut", "pencil", "pepper", "piano", "pillow", "pirate", "planet", "pocket", "potato",
    "pumpkin", "puppet", "rabbit", "radish", "raven", "razor", "robin", "salmon", "sandal", "satin", "scarf",
    "scissors", "shovel", "sparrow", "spider", "spinach", "spoon", "squirrel", "statue", "stove", "summit", "sweater",
    "teapot", "tiger", "timber", "tomato", "towel", "tractor", "trumpet", "tulip", "turkey", "turtle", "umbrella",
    "village", "vulture", "wagon", "walnut", "walrus", "whistle", "window", "winter", "wizard", "yogurt", "zebra",
    "absorb", "admire", "arrange", "balance", "bounce", "breathe", "carve", "chase", "climb", "collect", "crawl",
    "deliver", "explore", "fetch", "float", "gather", "giggle", "glide", "hike", "inspect", "juggle", "knit", "laugh",
    "launch", "listen", "melt", "mend", "navigate", "observe", "paint", "polish", "pour", "relax", "repair", "rescue",
    "roam", "sculpt", "shiver", "sing", "sketch", "slide", "sneeze", "sparkle", "splash", "sprint", "stitch",
    "stretch", "swim", "swing", "tickle", "travel", "tumble", "twirl", "unfold", "vanish", "wander", "weave",
    "whisper", "wiggle", "wobble", "yawn", "ancient", "anxious", "awkward", "bitter", "blunt", "bouncy", "breezy",
    "bumpy", "cheerful", "chilly", "clever", "cloudy", "clumsy", "cozy", "creamy", "crooked", "curious", "curly",
    "dainty", "damp", "dizzy", "dreamy", "drowsy", "fierce", "fluffy", "foggy", "fragile", "friendly", "fuzzy",
    "giant", "gloomy", "glossy", "greasy", "grumpy", "hasty", "heavy", "hungry", "itchy", "jittery", "juicy", "lazy",
    "leafy", "lonely", "mighty", "muddy", "nervous", "nimble", "noisy", "plump", "polite", "prickly", "puffy",
    "salty", "sandy", "scary", "shaggy", "shiny", "silky", "sleepy", "slimy", "smoky", "soggy", "sour", "spicy",
    "spiky", "steep", "sticky", "stormy", "sturdy", "sunny", "swift", "tame", "tasty", "thirsty", "tiny", "tricky",
    "wavy", "weary", "windy", "witty", "wooden", "zany", "acorn", "airport", "alley", "almond", "altar", "anchovy",
    "ankle", "antelope", "apron", "aquarium", "arch", "armchair", "artist", "asparagus", "attic", "avocado", "axle",
    "badger", "bagel", "ballet", "balloon", "bandage", "banjo", "banker", "barber", "barn", "baseball", "bathtub",
    "beaver", "bedroom", "beetle", "bellows", "bench", "biscuit", "bison", "blender", "blizzard", "blueberry", "boat",
    "bonnet", "bookcase", "boulder", "bouquet", "bowl", "bracelet", "brain", "brook", "brush", "bubble", "buckle",
    "bulldozer", "bunny", "burrow", "butterfly", "cafe", "calendar", "canal", "candy", "canoe", "captain", "caramel",
    "cardigan", "cargo", "carnival", "cart", "cashew", "cathedral", "cauliflower", "cave", "ceiling", "celery",
    "chapel", "cheese", "cheetah", "chef", "chess", "chicken", "chisel", "chocolate", "cinnamon", "citrus", "clam",
    "clarinet", "classroom", "clover", "coach", "coat", "cobra", "cockpit", "cocoa", "coin", "cookie", "coral",
    "cottage", "couch", "cowboy", "coyote", "crab", "crane", "creek", "crocodile", "crown", "cucumber", "cupboard",
    "curtain", "custard", "cymbal", "dancer", "dentist", "dessert", "dinosaur", "doctor", "doorbell", "dough", "dove",
    "dragonfly", "drummer", "duck", "dumpling", "dune", "eclipse", "eggplant", "elevator", "emerald", "farmer",
    "faucet", "fern", "firefly", "fireplace", "fisherman", "flamingo", "flask", "flour", "fork", "frog", "fudge",
    "gazelle", "gecko", "geyser", "goat", "goose", "gorilla", "granite", "grasshopper", "greenhouse", "grill",
    "guard", "hallway", "hamburger", "hammock", "harp", "hawk", "hedgehog", "heron", "hippo", "hockey", "hoof",
    "hotel", "hummingbird", "igloo", "iguana", "jeep", "jellyfish", "jigsaw", "juice", "kangaroo", "kayak", "kite",
    "knight", "knot", "labyrinth", "lake", "lamb", "lamp", "lark", "lava", "lawn", "ledge", "lighthouse", "lily",
    "lime", "lion", "llama", "lobby", "lotus", "luggage", "lynx", "macaroni", "mailbox", "mammoth", "mantis",
    "marathon", "marigold", "mask", "mattress", "mayor", "meteor", "microscope", "mill", "mint", "mole", "monsoon",
    "moose", "moss", "motor", "mountain", "mouse", "mule", "museum", "mustard", "nest", "noodle", "nurse", "octopus",
    "omelet", "orchid", "ostrich", "oven", "paddock", "pail", "panda", "pantry", "paper", "parade", "parsley",
    "pasta", "pastry", "path", "peacock", "pelican", "penguin", "pickle", "pier", "pigeon", "pilot", "pizza", "plank",
    "plate", "platypus", "pond", "pony", "poppy", "porch", "porcupine", "pottery", "prairie", "pretzel", "puddle",
    "puffin", "quail", "quilt", "raccoon", "raft", "rainbow", "raisin", "reef", "reindeer", "rhino", "rice", "robot",
    "roof", "rooster", "rose", "sailor", "salad", "sandwich", "sardine", "sausage", "scooter", "seagull", "seal",
    "seed", "shark", "sheep", "shell", "shrimp", "skunk", "sled", "sloth", "snail", "snake", "sock", "sofa", "soup",
    "spaghetti", "sponge", "spruce", "stable", "stadium", "stamp", "starfish", "stool", "strawberry", "submarine",
    "sunflower", "swan", "syrup", "tablet", "taco", "tadpole", "tailor", "tangerine", "tent", "termite", "theater",
    "thimble", "thistle", "toad", "toaster", "tofu", "tortoise", "tower", "trolley", "trout", "truck", "tuba", "tuna",
    "twig", "vanilla", "vase", "vinegar", "volcano", "waffle", "waiter", "wallet", "wardrobe", "wasp", "waterfall",
    "weasel", "whale", "wheat", "wheel", "wolf", "woodpecker", "wool", "worm", "yacht", "bloom", "blush", "borrow",
    "brew", "chew", "chirp", "clap", "crouch", "dash", "doodle", "drizzle", "dust", "fidget", "flicker", "flip",
    "flutter", "frolic", "gallop", "gargle", "glow", "gobble", "grin", "growl", "gulp", "hover", "hurry", "jingle",
    "kneel", "knock", "leap", "linger", "mumble", "munch", "nibble", "peek", "pinch", "plunge", "prance", "quack",
    "rattle", "ripple", "rumble", "rustle", "scamper", "scribble", "scrub", "shrug", "skate", "slurp", "smile",
    "sniff", "snore", "snuggle", "soar", "sprinkle", "squeeze", "stomp", "stroll", "swirl", "tiptoe", "toss", "trot",
    "twinkle", "wade", "waddle", "wave", "whirl", "wrestle", "yodel", "zoom", "bashful", "brisk", "chubby", "crunchy",
    "dusky", "feeble", "fizzy", "flaky", "frosty", "gigantic", "glassy", "gleaming", "grassy", "gritty", "hairy",
    "handsome", "humid", "lanky", "lumpy", "marvelous", "merry", "messy", "milky", "mushy", "nutty", "oily",
    "peaceful", "perky", "pudgy", "quaint", "rainy", "rosy", "rowdy", "scruffy", "shabby", "silly", "skinny",
    "slender", "slippery", "snowy", "sparkly", "speckled", "spotty", "squeaky", "starry", "stubby", "sugary",
    "sweaty", "tangy", "thorny", "toasty", "velvety", "wiggly", "wrinkly",
};
// clang-format on
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

const std::vector<std::string>& split_words(LongSplit s) {
  static const std::array<std::vector<std::string>, 2> halves = [] {
    std::array<std::vector<std::string>, 2> h;  // eval, train
    for (size_t i = 0; i < kNumWords; ++i) h[i % 2].push_back(kWords[i]);
    return h;
  }();
  return halves[s == LongSplit::Eval ? 0 : 1];
}

using Rng = SplitMix64;
constexpr auto enc = encode_piece;

void append(std::vector<int64_t>& dst, const std::vector<int64_t>& src) {
  dst.insert(dst.end(), src.begin(), src.end());
}

// `t` with every "{name}" replaced by its value.
std::string fill(std::string t, const std::vector<std::pair<const char*, std::string>>& values) {
  for (const auto& [name, value] : values) {
    const std::string ph = std::string("{") + name + "}";
    for (size_t p = t.find(ph); p != std::string::npos; p = t.find(ph, p + value.size()))
      t.replace(p, ph.size(), value);
  }
  return t;
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
  return s;
}

std::string random_letters(Rng& rng, int n, char first) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (char)(first + rng.below(26));
  return s;
}

// n strings from make(), distinct and not in `taken`; all are added to `taken`.
std::vector<std::string> distinct(int64_t n, const std::function<std::string()>& make, std::set<std::string>& taken) {
  std::vector<std::string> out;
  while ((int64_t)out.size() < n) {
    std::string s = make();
    if (taken.insert(s).second) out.push_back(s);
  }
  return out;
}

// Prompt frame: [BOS] chat prefix + lead, ... body ..., "\n" + question + chat suffix [+ answer prefix].
struct Frame {
  std::vector<int64_t> head, tail;
};
Frame frame(const Tokenizer& tok, const LongTaskOptions& opt, const std::string& lead, const std::string& question,
            const std::string& answer) {
  Frame f;
  if (tok.bos_id() >= 0) f.head.push_back(tok.bos_id());
  append(f.head, enc(tok, chat_user_open(opt.chat) + lead));
  f.tail = enc(tok, "\n" + question + chat_user_close(opt.chat) + (opt.answer_prefix ? answer : ""));
  return f;
}

std::string too_small(const LongTaskOptions& opt, const std::string& what, int64_t need) {
  std::ostringstream s;
  s << opt.task << ": context_tokens " << opt.context_tokens << " is too small: " << what << " alone take " << need
    << " tokens";
  return s.str();
}

// Filler lines from next() (each encoded on its own, "\n" included) until `budget`
// tokens are used; the last line is cut at a token boundary if it overflows.
struct Filler {
  std::vector<std::vector<int64_t>> lines;
  std::vector<int64_t> boundary{0};  // token offset of each line start, then the end
  bool last_cut = false;
  // Boundaries before a whole line (or at the end after a whole last line) qualify for facts.
  size_t max_slot() const { return last_cut ? lines.size() - 1 : lines.size(); }
};
Filler fill_lines(const Tokenizer& tok, int64_t budget, const std::function<std::string()>& next) {
  Filler f;
  int64_t used = 0;
  while (used < budget) {
    auto ids = enc(tok, next());
    if (used + (int64_t)ids.size() > budget) {
      ids.resize(budget - used);
      f.last_cut = true;
    }
    used += (int64_t)ids.size();
    f.lines.push_back(std::move(ids));
    f.boundary.push_back(used);
  }
  return f;
}

// Appends the filler with fact i inserted before filler line slot[i] (facts at the
// same slot keep their order) and records each fact's first token position.
void interleave(LongSample& out, const Filler& f, const std::vector<std::vector<int64_t>>& facts,
                const std::vector<size_t>& slot) {
  std::vector<size_t> order(facts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return slot[a] < slot[b]; });
  size_t k = 0;
  for (size_t b = 0; b <= f.lines.size(); ++b) {
    for (; k < order.size() && slot[order[k]] == b; ++k) {
      out.needle_positions.push_back((int64_t)out.prompt_ids.size());
      append(out.prompt_ids, facts[order[k]]);
    }
    if (b < f.lines.size()) append(out.prompt_ids, f.lines[b]);
  }
}

// Appends extra(0), extra(1), ... until out.prompt_ids holds `end` tokens; the last
// piece is cut at a token boundary.
void fill_to(LongSample& out, int64_t end, const std::function<std::vector<int64_t>(size_t)>& extra) {
  for (size_t i = 0; (int64_t)out.prompt_ids.size() < end; ++i) {
    auto ids = extra(i);
    ids.resize(std::min<int64_t>((int64_t)ids.size(), end - (int64_t)out.prompt_ids.size()));
    append(out.prompt_ids, ids);
  }
}

std::string join(const std::vector<std::string>& v, const std::string& sep, const std::string& last_sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? last_sep : sep) + v[i];
  return s;
}

// ---- niah_* -----------------------------------------------------------------

std::string random_value(Rng& rng, Value kind, const std::vector<std::string>& words) {
  switch (kind) {
    case Value::Digits: return std::to_string(1000000 + rng.below(9000000));
    case Value::Words: {
      size_t a = rng.below(words.size()), b = rng.below(words.size() - 1);
      return words[a] + "-" + words[b + (b >= a)];
    }
    case Value::Uuid: {  // version 4 layout, as Python's uuid.UUID(int=..., version=4)
      static const char* hex = "0123456789abcdef";
      std::string s;
      for (int i = 0; i < 32; ++i) {
        int d = (int)rng.below(16);
        if (i == 12) d = 4;
        if (i == 16) d = 8 + (d & 3);
        if (i == 8 || i == 12 || i == 16 || i == 20) s += '-';
        s += hex[d];
      }
      return s;
    }
  }
  return {};
}

void make_niah_task(const Tokenizer& tok, const LongTaskOptions& opt, const Task& task, Rng& rng, LongSample& out) {
  const Templates& T = templates(opt.split);
  const auto& words = split_words(opt.split);
  const int kind = (int)task.value;
  std::set<std::string> taken;
  auto key = [&] { return random_value(rng, Value::Words, words); };
  auto value = [&] { return random_value(rng, task.value, words); };
  auto keys = distinct(task.keys, key, taken);
  // values[k]: the values of keys[k]; needles: (key, value) in random order, as RULER shuffles them.
  std::vector<std::vector<std::string>> values;
  std::vector<std::pair<std::string, std::string>> needles;
  for (const auto& key : keys) {
    values.push_back(distinct(task.values_per_key, value, taken));
    for (const auto& v : values.back()) needles.emplace_back(key, v);
  }
  rng.shuffle(needles);
  std::vector<size_t> asked(keys.size());
  for (size_t k = 0; k < asked.size(); ++k) asked[k] = k;
  rng.shuffle(asked);
  asked.resize(task.queries);
  std::vector<std::string> query_keys;
  for (size_t k : asked) {
    query_keys.push_back(keys[k]);
    out.answers.insert(out.answers.end(), values[k].begin(), values[k].end());
  }
  const bool one = out.answers.size() == 1;
  const std::vector<std::pair<const char*, std::string>> names{{"type", T.value_kind[kind][0]},
                                                               {"types", T.value_kind[kind][1]},
                                                               {"query", join(query_keys, ", ", T.query_last_sep)}};
  Frame fr = frame(tok, opt, fill(one ? T.niah_instruction_one : T.niah_instruction_many, names),
                   fill(one ? T.niah_question_one : T.niah_question_many, names),
                   fill(one ? T.niah_answer_one : T.niah_answer_many, names));
  std::vector<std::vector<int64_t>> facts;
  int64_t fixed = (int64_t)(fr.head.size() + fr.tail.size());
  for (const auto& [key, value] : needles) {
    facts.push_back(
        enc(tok,
            fill(T.niah_needle,
                 {{"types", T.value_kind[kind][1]}, {"type", T.value_kind[kind][0]}, {"key", key}, {"value", value}})));
    fixed += (int64_t)facts.back().size();
  }
  const int64_t budget = opt.context_tokens - fixed;
  KAKEYA_CHECK(
      budget >= 0,
      too_small(opt, "the instruction, " + std::to_string(needles.size()) + " needle(s) and the question", fixed));

  // Depths: distinct draws from RULER's 40 (round(linspace(0, 100, 40)) %), ascending, one per needle.
  std::vector<int> depth_ids(40);
  for (int i = 0; i < 40; ++i) depth_ids[i] = i;
  rng.shuffle(depth_ids);
  depth_ids.resize(needles.size());
  std::sort(depth_ids.begin(), depth_ids.end());

  const auto& lines = haystack_lines(opt.haystack_file.empty() ? default_long_haystack_file(opt.split, opt.source_dir)
                                                               : opt.haystack_file);
  size_t li = rng.below(lines.size());
  Filler f = fill_lines(tok, budget, [&] {
    const std::string& l = lines[li];
    li = (li + 1) % lines.size();
    return l + "\n";
  });
  // Each needle goes to the qualifying boundary nearest its depth (ties: earlier).
  std::vector<size_t> slot(needles.size());
  for (size_t i = 0; i < needles.size(); ++i) {
    const double target = std::round(100.0 * depth_ids[i] / 39.0) / 100.0 * (double)budget;
    size_t best = 0;
    for (size_t b = 0; b <= f.max_slot(); ++b)
      if (std::abs((double)f.boundary[b] - target) < std::abs((double)f.boundary[best] - target)) best = b;
    slot[i] = best;
  }
  out.prompt_ids = fr.head;
  interleave(out, f, facts, slot);
  append(out.prompt_ids, fr.tail);
}

// ---- vt ---------------------------------------------------------------------

// One chain: names[0] = value, names[j+1] = names[j] (RULER: 1 chain, 4 hops).
std::vector<std::string> vt_statements(const Templates& T, const std::vector<std::string>& names,
                                       const std::string& value) {
  std::vector<std::string> s{fill(T.vt_assign_value, {{"x", names[0]}, {"value", value}})};
  for (size_t j = 1; j < names.size(); ++j) s.push_back(fill(T.vt_assign_var, {{"y", names[j]}, {"x", names[j - 1]}}));
  return s;
}

void make_vt_task(const Tokenizer& tok, const LongTaskOptions& opt, Rng& rng, LongSample& out) {
  const Templates& T = templates(opt.split);
  constexpr int kChainNames = 5;  // 4 hops
  const std::string count = std::to_string(kChainNames);
  auto question = [&](const std::string& value) { return fill(T.vt_question, {{"value", value}}); };
  auto answer = [&](const std::string& value) { return fill(T.vt_answer, {{"n", count}, {"value", value}}); };

  // In-context example (RULER prepends one): 5 noise lines, statements at random line boundaries.
  std::set<std::string> taken;
  auto ex_name = [&] { return random_letters(rng, T.vt_example_name_letters, 'A'); };
  auto ex_names = distinct(kChainNames, ex_name, taken);
  const std::string ex_value = std::to_string(10000 + rng.below(90000));
  auto ex_statements = vt_statements(T, ex_names, ex_value);
  std::vector<size_t> ex_slot(kChainNames);
  for (auto& s : ex_slot) s = rng.below(6);
  std::sort(ex_slot.begin(), ex_slot.end());
  std::string example = T.vt_instruction;
  for (size_t b = 0, k = 0; b <= 5; ++b) {
    for (; k < ex_slot.size() && ex_slot[k] == b; ++k) example += ex_statements[k];
    if (b < 5) example += T.vt_noise;
  }
  example += "\n" + question(ex_value) + "\n" + answer(ex_value) + " " + join(ex_names, " ", " ") + "\n\n";

  auto name = [&] { return random_letters(rng, T.vt_name_letters, 'A'); };
  auto names = distinct(kChainNames, name, taken);
  const std::string value = std::to_string(10000 + rng.below(90000));
  out.answers = names;
  Frame fr = frame(tok, opt, example + T.vt_instruction, question(value), answer(value));
  std::vector<std::vector<int64_t>> facts;
  int64_t fixed = (int64_t)(fr.head.size() + fr.tail.size());
  for (const auto& s : vt_statements(T, names, value)) {
    facts.push_back(enc(tok, s));
    fixed += (int64_t)facts.back().size();
  }
  const int64_t budget = opt.context_tokens - fixed;
  KAKEYA_CHECK(budget >= 0, too_small(opt, "the example, the instruction, 5 assignments and the question", fixed));
  Filler f = fill_lines(tok, budget, [&] { return std::string(T.vt_noise); });
  std::vector<size_t> slot(facts.size());
  for (auto& s : slot) s = rng.below(f.max_slot() + 1);
  std::sort(slot.begin(), slot.end());
  out.prompt_ids = fr.head;
  interleave(out, f, facts, slot);
  append(out.prompt_ids, fr.tail);
}

// ---- cwe --------------------------------------------------------------------

void make_cwe_task(const Tokenizer& tok, const LongTaskOptions& opt, Rng& rng, LongSample& out) {
  const Templates& T = templates(opt.split);
  constexpr size_t kCommon = 10;
  // RULER: below 4096 tokens common words appear 6 times and the others once (example:
  // 20 words, 3 and 1), else 30 and 3 (example: 40 words, 10 and 3).
  const bool small = opt.context_tokens < 4096;
  const int64_t cw0 = small ? 6 : 30, ucw0 = small ? 1 : 3;
  const size_t ex_words = small ? 20 : 40;
  const int64_t ex_cw = small ? 3 : 10, ex_ucw = small ? 1 : 3;

  auto number = [&](int64_t i) { return (i > 1 ? " " : "") + fill(T.cwe_item, {{"n", std::to_string(i)}}); };
  auto listing = [&](const std::vector<std::string>& items) {
    std::string s;
    for (size_t i = 0; i < items.size(); ++i) s += number((int64_t)i + 1) + " " + items[i];
    return s;
  };
  auto repeat = [](const std::vector<std::string>& w, size_t from, size_t to, int64_t times) {
    std::vector<std::string> out;
    for (size_t i = from; i < to; ++i) out.insert(out.end(), (size_t)times, w[i]);
    return out;
  };

  // Word roles: common, example words, then the pool of uncommon words.
  std::vector<std::string> vocab = split_words(opt.split);
  rng.shuffle(vocab);
  const std::vector<std::string> common(vocab.begin(), vocab.begin() + kCommon);
  const std::vector<std::string> pool(vocab.begin() + kCommon + ex_words, vocab.end());

  std::vector<std::string> ex_items = repeat(vocab, kCommon, kCommon + kCommon, ex_cw);
  const auto ex_rare = repeat(vocab, kCommon + kCommon, kCommon + ex_words, ex_ucw);
  ex_items.insert(ex_items.end(), ex_rare.begin(), ex_rare.end());
  rng.shuffle(ex_items);
  const std::string example =
      T.cwe_instruction + listing(ex_items) + "\n" + T.cwe_question + "\n" + T.cwe_answer + " " +
      listing(std::vector<std::string>(vocab.begin() + kCommon, vocab.begin() + 2 * kCommon)) + "\n";
  out.answers = common;
  Frame fr = frame(tok, opt, example + T.cwe_instruction, T.cwe_question, T.cwe_answer);
  const int64_t budget = opt.context_tokens - (int64_t)(fr.head.size() + fr.tail.size());

  // Token counts: number pieces (prefix sums over item numbers) and word pieces; a
  // list's length depends only on its size and word multiset, not on its order.
  std::vector<int64_t> number_sum{0};  // number_sum[N]: tokens of the numbers 1..N
  auto numbers = [&](int64_t n) {
    while ((int64_t)number_sum.size() <= n)
      number_sum.push_back(number_sum.back() + (int64_t)enc(tok, number((int64_t)number_sum.size())).size());
    return number_sum[n];
  };
  std::map<std::string, std::vector<int64_t>> word_ids;
  auto word = [&](const std::string& w) -> const std::vector<int64_t>& {
    auto it = word_ids.find(w);
    return it != word_ids.end() ? it->second : word_ids.emplace(w, enc(tok, " " + w)).first->second;
  };
  int64_t common_tokens = 0;
  for (const auto& w : common) common_tokens += (int64_t)word(w).size();
  const int64_t min_list = numbers(kCommon * cw0) + cw0 * common_tokens;
  KAKEYA_CHECK(budget >= min_list,
               too_small(opt, "the example, the instruction, the question and 10 words x " + std::to_string(cw0),
                         opt.context_tokens - budget + min_list));

  // The list holds the common words cw times and the first n pool words ucw times,
  // n as large as fits. When the pool runs out with room to spare, both counts grow
  // by the same factor (the 10:1 ratio of RULER), so any length is reachable.
  int64_t cw = 0, ucw = 0;
  size_t n = 0;
  int64_t list_tokens = 0;
  for (int64_t k = 1;; ++k) {
    cw = k * cw0;
    ucw = k * ucw0;
    n = 0;
    int64_t rare_tokens = 0;
    list_tokens = numbers((int64_t)kCommon * cw) + cw * common_tokens;
    KAKEYA_CHECK(list_tokens <= budget, "cwe: internal sizing error at repetition factor " << k);
    while (n < pool.size()) {
      const int64_t next = numbers((int64_t)kCommon * cw + (int64_t)(n + 1) * ucw) + cw * common_tokens +
                           ucw * (rare_tokens + (int64_t)word(pool[n]).size());
      if (next > budget) break;
      rare_tokens += (int64_t)word(pool[n]).size();
      list_tokens = next;
      ++n;
    }
    if (n < pool.size() || list_tokens == budget) break;
  }
  std::vector<std::string> items = repeat(common, 0, kCommon, cw);
  const auto rare = repeat(pool, 0, n, ucw);
  items.insert(items.end(), rare.begin(), rare.end());
  rng.shuffle(items);

  out.prompt_ids = fr.head;
  for (size_t i = 0; i < items.size(); ++i) {
    append(out.prompt_ids, enc(tok, number((int64_t)i + 1)));
    append(out.prompt_ids, word(items[i]));
  }
  // The remainder (less than one more pool word's ucw items): more items, one per
  // unused pool word (count 1), then one more of each used one (ucw + 1 < cw).
  const int64_t list_end = (int64_t)fr.head.size() + budget;
  fill_to(out, list_end, [&](size_t i) {
    auto ids = enc(tok, number((int64_t)(items.size() + i) + 1));
    append(ids, word(pool[(n + i) % pool.size()]));
    return ids;
  });
  append(out.prompt_ids, fr.tail);
}

// ---- fwe --------------------------------------------------------------------

void make_fwe_task(const Tokenizer& tok, const LongTaskOptions& opt, Rng& rng, LongSample& out) {
  const Templates& T = templates(opt.split);
  constexpr double kZeta2 = 1.6449340668482264;  // ζ(α) for RULER's α = 2
  // Vocabulary: RULER's context/50 words (at least 16); rank 1 is the noise word.
  const int64_t vocab_size = std::max<int64_t>(opt.context_tokens / 50, 16);
  std::set<std::string> taken;
  auto coded = [&] { return random_letters(rng, T.fwe_word_letters, 'a'); };
  auto vocab = distinct(vocab_size - 1, coded, taken);
  vocab.insert(vocab.begin(), T.fwe_noise);
  out.answers.assign(vocab.begin() + 1, vocab.begin() + 4);
  std::vector<std::vector<int64_t>> ids;
  for (const auto& w : vocab) ids.push_back(enc(tok, " " + w));

  // Zipf counts of W words: c_k = floor(W k^-2 / ζ(2)), k = 1..vocab_size.
  auto count = [&](int64_t W, int64_t k) { return (int64_t)std::floor((double)W / (kZeta2 * (double)(k * k))); };
  auto tokens = [&](int64_t W) {
    int64_t t = 0;
    for (int64_t k = 1; k <= vocab_size; ++k) t += count(W, k) * (int64_t)ids[k - 1].size();
    return t;
  };
  // At W >= 68, W (1/9 - 1/16) / ζ(2) >= 2: rank 4's count is at least 1 below rank
  // 3's, and rank 3's (>= 4) above the once-only words that fill the remainder.
  constexpr int64_t kMinWords = 68;
  Frame fr = frame(tok, opt, T.fwe_instruction, T.fwe_question, T.fwe_answer);
  const int64_t budget = opt.context_tokens - (int64_t)(fr.head.size() + fr.tail.size());
  const int64_t min_text = tokens(kMinWords);
  KAKEYA_CHECK(budget >= min_text,
               too_small(opt, "the instruction, the question and " + std::to_string(kMinWords) + " coded words",
                         opt.context_tokens - budget + min_text));
  int64_t lo = kMinWords, hi = kMinWords;  // tokens(lo) <= budget < tokens(hi)
  while (tokens(hi) <= budget) hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (tokens(mid) <= budget ? lo : hi) = mid;
  }
  std::vector<int64_t> text;  // word indices
  for (int64_t k = 1; k <= vocab_size; ++k) text.insert(text.end(), (size_t)count(lo, k), k - 1);
  rng.shuffle(text);
  out.prompt_ids = fr.head;
  for (int64_t w : text) append(out.prompt_ids, ids[w]);
  // The remainder: fresh coded words, once each.
  fill_to(out, (int64_t)fr.head.size() + budget, [&](size_t) { return enc(tok, " " + distinct(1, coded, taken)[0]); });
  append(out.prompt_ids, fr.tail);
}

const Task& find_task(const std::string& name) {
  for (const auto& t : kTasks)
    if (name == t.name) return t;
  std::string all;
  for (const auto& t : kTasks) all += std::string(all.empty() ? "" : ", ") + t.name;
  KAKEYA_FAIL("unknown task '" << name << "': expected one of " << all);
}

}  // namespace

const char* long_split_name(LongSplit s) { return s == LongSplit::Train ? "train" : "eval"; }

std::vector<std::string> long_task_names() {
  std::vector<std::string> names;
  for (const auto& t : kTasks) names.push_back(t.name);
  return names;
}

int64_t long_task_max_new_tokens() {
  int64_t n = 0;
  for (const auto& t : kTasks) n = std::max(n, t.max_new_tokens);
  return n;
}

void check_long_task(const std::string& name) { find_task(name); }

std::string default_long_haystack_file(LongSplit s, const std::string& source_dir) {
  return source_dir + (s == LongSplit::Eval ? "/longeval/haystack_eval.txt" : "/codec/calib.txt");
}

LongSample make_long_sample(const Tokenizer& tok, const LongTaskOptions& opt) {
  const Task& task = find_task(opt.task);
  KAKEYA_CHECK(opt.seed < kSeedLimit, opt.task << ": seed must be < 2^40, got " << opt.seed);
  LongSample out;
  out.task = task.name;
  out.max_new_tokens = task.max_new_tokens;
  out.rng_seed = opt.seed + (opt.split == LongSplit::Train ? kTrainSeedOffset : 0);
  // The generator state also depends on the task (rng_seed < 2^42, the task index
  // above bit 48), so tasks sharing a seed do not share draws.
  Rng rng{out.rng_seed | (uint64_t)(&task - kTasks) << 48};
  switch (task.family) {
    case Family::Niah: make_niah_task(tok, opt, task, rng, out); break;
    case Family::Vt: make_vt_task(tok, opt, rng, out); break;
    case Family::Cwe: make_cwe_task(tok, opt, rng, out); break;
    case Family::Fwe: make_fwe_task(tok, opt, rng, out); break;
  }
  KAKEYA_CHECK((int64_t)out.prompt_ids.size() == opt.context_tokens,
               opt.task << ": internal length error: built " << out.prompt_ids.size() << " tokens for "
                        << opt.context_tokens);
  out.prompt_text = tok.decode(std::vector<int32_t>(out.prompt_ids.begin(), out.prompt_ids.end()));
  return out;
}

double long_task_score(const std::vector<std::string>& answers, const std::string& generated) {
  if (answers.empty()) return 0.0;
  const std::string g = lower(generated);
  int64_t hit = 0;
  for (const auto& a : answers) hit += g.find(lower(a)) != std::string::npos;
  return (double)hit / (double)answers.size();
}

std::vector<std::string> long_template_phrases(LongSplit s) {
  const Templates& T = templates(s);
  const char* all[] = {T.niah_instruction_one, T.niah_instruction_many, T.niah_needle, T.niah_question_one,
                       T.niah_question_many, T.niah_answer_one, T.niah_answer_many, T.vt_instruction, T.vt_noise,
                       T.vt_assign_value, T.vt_assign_var, T.vt_question, T.vt_answer, T.cwe_instruction, T.cwe_item,
                       T.cwe_question, T.cwe_answer, T.fwe_instruction, T.fwe_noise, T.fwe_question, T.fwe_answer};
  std::set<std::string> phrases;
  for (const char* t : all) {
    // Cut at placeholders and line breaks, trim spaces.
    std::string piece;
    auto flush = [&] {
      const size_t a = piece.find_first_not_of(' '), b = piece.find_last_not_of(' ');
      if (a != std::string::npos && b - a + 1 >= 12) phrases.insert(piece.substr(a, b - a + 1));
      piece.clear();
    };
    for (const char* p = t; *p; ++p) {
      if (*p == '{') {
        flush();
        while (*p && *p != '}') ++p;
        if (!*p) break;
      } else if (*p == '\n') {
        flush();
      } else {
        piece += *p;
      }
    }
    flush();
  }
  return std::vector<std::string>(phrases.begin(), phrases.end());
}

}  // namespace kakeya::data
