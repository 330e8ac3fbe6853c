package ai.banyan.client;

import ai.banyan.v1.ChatInput;
import ai.banyan.v1.ChatMessage;
import ai.banyan.v1.FinishReason;
import ai.banyan.v1.GenerateRequest;
import ai.banyan.v1.GenerateResponse;
import ai.banyan.v1.GenerationServiceGrpc;
import ai.banyan.v1.GetModelInfoRequest;
import ai.banyan.v1.GetModelInfoResponse;
import ai.banyan.v1.SamplingParams;
import ai.banyan.v1.Usage;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.StatusRuntimeException;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import io.grpc.stub.MetadataUtils;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import java.util.concurrent.TimeUnit;

/**
 * A minimal Java client of Banyan's gRPC API ({@code banyan.v1.GenerationService}).
 *
 * <p>It checks the standard health service, prints the served model (GetModelInfo), then streams
 * one Generate call: the text is printed as each message arrives, followed by the finish reason
 * and the token usage. The stubs are generated from {@code protos/} by protoc and the gRPC Java
 * plugin (see README.md); none of the wire code is written by hand.
 */
public final class BanyanClient {
  private static final String USAGE =
      "usage: banyan-client [--target HOST:PORT] [--prompt TEXT] [--chat] [--max-tokens N]\n"
          + "                     [--temperature T] [--api-key KEY] [--timeout-seconds S]\n"
          + "  --target           server address (default localhost:50051)\n"
          + "  --prompt           the prompt (default \"Once upon a time\")\n"
          + "  --chat             send the prompt as one user chat message (chat template)\n"
          + "  --max-tokens       most new tokens to generate (default 32)\n"
          + "  --temperature      softmax temperature, 0 = greedy (default 0)\n"
          + "  --api-key          sent as 'authorization: Bearer KEY' (default $BANYAN_API_KEY)\n"
          + "  --timeout-seconds  deadline of each call (default 300)\n";

  private String target = "localhost:50051";
  private String prompt = "Once upon a time";
  private boolean chat = false;
  private int maxTokens = 32;
  private float temperature = 0f;
  private String apiKey = System.getenv().getOrDefault("BANYAN_API_KEY", "");
  private long timeoutSeconds = 300;

  // UTF-8 whatever the locale (the JVM's default stdout charset under LANG=C would print '?').
  private final PrintStream out =
      new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);

  public static void main(String[] args) throws InterruptedException {
    BanyanClient client = new BanyanClient();
    try {
      client.parse(args);
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage() + "\n" + USAGE);
      System.exit(2);
    }
    System.exit(client.run());
  }

  private void parse(String[] args) {
    for (int i = 0; i < args.length; i++) {
      String flag = args[i];
      if (flag.equals("--chat")) {
        chat = true;
        continue;
      }
      if (flag.equals("-h") || flag.equals("--help")) {
        System.out.print(USAGE);
        System.exit(0);
      }
      if (i + 1 >= args.length) {
        throw new IllegalArgumentException("missing value for " + flag);
      }
      String value = args[++i];
      try {
        switch (flag) {
          case "--target": target = value; break;
          case "--prompt": prompt = value; break;
          case "--max-tokens": maxTokens = Integer.parseInt(value); break;
          case "--temperature": temperature = Float.parseFloat(value); break;
          case "--api-key": apiKey = value; break;
          case "--timeout-seconds": timeoutSeconds = Long.parseLong(value); break;
          default: throw new IllegalArgumentException("unknown flag " + flag);
        }
      } catch (NumberFormatException e) {
        throw new IllegalArgumentException("bad number for " + flag + ": " + value);
      }
    }
  }

  private int run() throws InterruptedException {
    // The server speaks plaintext gRPC; put TLS in a proxy in front of it if needed.
    ManagedChannelBuilder<?> builder = ManagedChannelBuilder.forTarget(target).usePlaintext();
    if (!apiKey.isEmpty()) {
      Metadata headers = new Metadata();
      headers.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + apiKey);
      builder.intercept(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    ManagedChannel channel = builder.build();
    try {
      HealthCheckResponse health = HealthGrpc.newBlockingStub(channel)
          .withDeadlineAfter(timeoutSeconds, TimeUnit.SECONDS)
          .check(HealthCheckRequest.newBuilder().setService("banyan.v1.GenerationService").build());
      out.println("health: " + health.getStatus());

      GenerationServiceGrpc.GenerationServiceBlockingStub stub = GenerationServiceGrpc.newBlockingStub(channel);
      GetModelInfoResponse info = stub.withDeadlineAfter(timeoutSeconds, TimeUnit.SECONDS)
          .getModelInfo(GetModelInfoRequest.getDefaultInstance());
      out.printf("model: %s architecture=%s device=%s dtype=%s context_length=%d vocab_size=%d%n",
          info.getModel(), info.getArchitecture(), info.getDevice(), info.getDtype(),
          info.getContextLength(), info.getVocabSize());

      GenerateRequest.Builder req = GenerateRequest.newBuilder()
          .setSamplingParams(SamplingParams.newBuilder().setMaxTokens(maxTokens).setTemperature(temperature));
      if (chat) {
        req.setChat(ChatInput.newBuilder()
            .addMessages(ChatMessage.newBuilder().setRole("user").setContent(prompt)));
      } else {
        req.setText(prompt);
      }
      out.println("--- generation");
      int messages = 0;
      GenerateResponse last = null;
      Iterator<GenerateResponse> stream =
          stub.withDeadlineAfter(timeoutSeconds, TimeUnit.SECONDS).generate(req.build());
      while (stream.hasNext()) {
        last = stream.next();
        messages++;
        out.print(last.getText());
        out.flush(); // each chunk shows as it arrives
      }
      if (last == null || last.getFinishReason() == FinishReason.FINISH_REASON_UNSPECIFIED) {
        System.err.println("error: Generate stream ended without a finish reason");
        return 1;
      }
      Usage u = last.getUsage();
      out.printf("%n--- finish_reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d messages=%d request_id=%s%n",
          last.getFinishReason(), u.getPromptTokens(), u.getCompletionTokens(), u.getCachedTokens(), messages,
          last.getRequestId());
      return 0;
    } catch (StatusRuntimeException e) {
      out.flush();
      System.err.println("error: " + e.getStatus());
      return 1;
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
  }
}
