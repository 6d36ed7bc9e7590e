// Chat templates: a conversation rendered as Llama 3, ChatML (Qwen2) or
// Mistral render it, with the text and ids equal to transformers'
// apply_chat_template over those models' own template strings, and each token
// flagged as a target (the assistant's words and its end-of-turn token) or
// context. `prepare corpus --format chat` stores the flags with the dataset;
// `nnstrain generate --chat` renders the history and stops at end_of_turn().
// Torch-free. docs/data.md ("Chat data") states the rules.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/tokenizer/tokenizer.h"

namespace nnstrain::data {

// A conversation that cannot be rendered (unknown role, no assistant turn, a
// role order the template refuses); one line.
struct ChatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ChatMessage {
  std::string role;  // system, user or assistant
  std::string content;
};

enum class TrainOn { all_assistant, last_assistant };

struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> target;     // per id: 1 = the loss counts it
  std::vector<size_t> turn_starts;  // ids indices where a user turn begins (cut points for splitting)
};

class ChatTemplate {
 public:
  // `name`: llama3, chatml or mistral. Throws ChatError naming the template and
  // the missing token if the tokenizer lacks one of the template's special tokens.
  ChatTemplate(const std::string& name, const tok::Tokenizer& tokenizer);
  static const std::vector<std::string>& names();
  // The name of the template whose Jinja text (tokenizer_config.json's
  // chat_template) this is, exactly; "" for any other text.
  static std::string identify(const std::string& jinja);

  const std::string& name() const { return name_; }
  // The rendered text (apply_chat_template(..., tokenize=False)).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // Ids of the rendered text: template tokens as their ids, message content as
  // text (special-token strings in content stay text). For training (no
  // generation prompt) a conversation needs an assistant turn.
  ChatTokens encode(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                    TrainOn train_on = TrainOn::all_assistant) const;
  int32_t end_of_turn() const { return end_of_turn_; }

 private:
  struct Part {
    std::string text;
    bool special = false;
    bool target = false;
    bool user_turn_start = false;
  };
  std::vector<Part> parts(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                          TrainOn train_on) const;

  std::string name_;
  const tok::Tokenizer* tok_;
  std::string bos_, eos_;  // mistral's <s> and </s>; llama3's <|begin_of_text|>
  int32_t end_of_turn_ = -1;
};

// Python's str.strip(): Unicode whitespace off both ends (Jinja's `trim`).
std::string strip_unicode_whitespace(const std::string& s);

}  // namespace nnstrain::data
