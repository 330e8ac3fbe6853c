// Command banyan-client is a minimal Go client of Banyan's gRPC API (banyan.v1.GenerationService).
//
// It checks the standard health service, prints the served model (GetModelInfo), then streams one
// Generate call: the text is printed as each message arrives, followed by the finish reason and
// the token usage. The stubs under gen/ are generated from protos/ (see README.md); none of the
// wire code is written by hand.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	banyanv1 "github.com/banyan-ai/banyan/clients/go/gen/banyan/v1"
)

func main() {
	target := flag.String("target", "localhost:50051", "server address, host:port")
	prompt := flag.String("prompt", "Once upon a time", "the prompt")
	chat := flag.Bool("chat", false, "send the prompt as one user chat message (rendered with the model's chat template)")
	maxTokens := flag.Uint("max-tokens", 32, "most new tokens to generate")
	temperature := flag.Float64("temperature", 0, "softmax temperature (0 = greedy)")
	apiKey := flag.String("api-key", os.Getenv("BANYAN_API_KEY"), "API key sent as 'authorization: Bearer <key>' (default $BANYAN_API_KEY)")
	timeout := flag.Duration("timeout", 5*time.Minute, "deadline for the whole run")
	flag.Parse()

	if err := run(*target, *prompt, *chat, uint32(*maxTokens), float32(*temperature), *apiKey, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(target, prompt string, chat bool, maxTokens uint32, temperature float32, apiKey string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if apiKey != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+apiKey)
	}
	// The server speaks plaintext gRPC; put TLS in a proxy in front of it if needed.
	conn, err := grpc.DialContext(ctx, target, grpc.WithInsecure())
	if err != nil {
		return fmt.Errorf("dial %s: %w", target, err)
	}
	defer conn.Close()

	health, err := grpc_health_v1.NewHealthClient(conn).Check(ctx,
		&grpc_health_v1.HealthCheckRequest{Service: "banyan.v1.GenerationService"})
	if err != nil {
		return fmt.Errorf("health check: %w", err)
	}
	fmt.Printf("health: %s\n", health.GetStatus())

	client := banyanv1.NewGenerationServiceClient(conn)
	info, err := client.GetModelInfo(ctx, &banyanv1.GetModelInfoRequest{})
	if err != nil {
		return fmt.Errorf("GetModelInfo: %w", err)
	}
	fmt.Printf("model: %s architecture=%s device=%s dtype=%s context_length=%d vocab_size=%d\n",
		info.GetModel(), info.GetArchitecture(), info.GetDevice(), info.GetDtype(),
		info.GetContextLength(), info.GetVocabSize())

	req := &banyanv1.GenerateRequest{
		SamplingParams: &banyanv1.SamplingParams{MaxTokens: &maxTokens, Temperature: &temperature},
	}
	if chat {
		req.Input = &banyanv1.GenerateRequest_Chat{Chat: &banyanv1.ChatInput{
			Messages: []*banyanv1.ChatMessage{{Role: "user", Content: prompt}},
		}}
	} else {
		req.Input = &banyanv1.GenerateRequest_Text{Text: prompt}
	}
	stream, err := client.Generate(ctx, req)
	if err != nil {
		return fmt.Errorf("Generate: %w", err)
	}
	fmt.Println("--- generation")
	messages := 0
	var last *banyanv1.GenerateResponse
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("Generate stream: %w", err)
		}
		messages++
		os.Stdout.WriteString(msg.GetText()) // unbuffered: each chunk shows as it arrives
		last = msg
	}
	if last == nil || last.GetFinishReason() == banyanv1.FinishReason_FINISH_REASON_UNSPECIFIED {
		return errors.New("Generate stream ended without a finish reason")
	}
	u := last.GetUsage()
	fmt.Printf("\n--- finish_reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d messages=%d request_id=%s\n",
		last.GetFinishReason(), u.GetPromptTokens(), u.GetCompletionTokens(), u.GetCachedTokens(), messages,
		last.GetRequestId())
	return nil
}
